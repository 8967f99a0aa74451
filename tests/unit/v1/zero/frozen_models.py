"""The seed's model (checkpointed blocks of a frozen LayerNorm then a trainable Linear), seeded, and its data."""
import torch
import torch.nn as nn

# The model of the seed's reproducer, which is also the training example.
from zero3_recompute.testing.frozen_blocks import CheckpointedModel

DIM = 16
BLOCKS = 2
MICRO_BATCH = 4
LR = 1e-3


def build_model(use_reentrant: bool, seed: int = 0) -> CheckpointedModel:
    torch.manual_seed(seed)
    model = CheckpointedModel(DIM, BLOCKS, use_reentrant)
    with torch.no_grad():
        # Non-trivial frozen affine params, so a wrong frozen weight changes the loss.
        for block in model.blocks:
            block.norm.weight.uniform_(0.5, 1.5)
            block.norm.bias.uniform_(-0.5, 0.5)
    return model


def global_batch(step: int, world_size: int, dim: int = DIM):
    """Every rank's micro-batch for ``step``; rank r uses rows [r * MICRO_BATCH, (r + 1) * MICRO_BATCH)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world_size * MICRO_BATCH, dim, generator=generator)
    target = torch.randn(world_size * MICRO_BATCH, dim, generator=generator)
    return x, target


def local_rows(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]


def trainable(model: nn.Module):
    return [param for param in model.parameters() if param.requires_grad]
