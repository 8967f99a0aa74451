"""What the small custom-model tests share: a chain of blocks, each checkpointed non-reentrant or
not, and its plain-torch SGD reference (no ZeRO, every rank's rows at once)."""
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class CheckpointedChain(nn.Module):
    """``blocks`` in a row, each under torch's non-reentrant checkpoint when ``checkpointing``; the
    loss is the mean squared error (in fp32) against the target."""

    def __init__(self, blocks: List[nn.Module], checkpointing: bool):
        super().__init__()
        self.checkpointing = checkpointing
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return F.mse_loss(x.float(), target)


def sgd_reference(model: nn.Module, rows: Tuple[torch.Tensor, torch.Tensor], steps: int,
                  lr: float) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """``steps`` of plain SGD over the trainable params on ``rows`` (inputs, targets): the loss per
    step and each trainable param at the end, in fp32."""
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=lr)
    x, target = rows
    losses = []
    for _ in range(steps):
        loss = model(x, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach().float().clone() for name, param in model.named_parameters()
                    if param.requires_grad}


