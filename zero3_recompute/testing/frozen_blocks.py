"""The seed's reproducer as a model: blocks of a frozen LayerNorm followed by a trainable Linear,
each under torch's activation checkpointing. LayerNorm saves its frozen weight for backward, so a
recompute that partitions it is caught by the checkpoint's metadata check.
"""
import torch
import torch.nn as nn
import torch.utils.checkpoint


class FrozenNormLinear(nn.Module):

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)
        self.norm.requires_grad_(False)

    def forward(self, x):
        return self.linear(self.norm(x))


class CheckpointedModel(nn.Module):

    def __init__(self, dim: int, blocks: int, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = nn.ModuleList(FrozenNormLinear(dim) for _ in range(blocks))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return nn.functional.mse_loss(x, target)
