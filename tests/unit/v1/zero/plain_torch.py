"""What the small custom-model tests share: a chain of blocks, each checkpointed non-reentrant or
not, and its plain-torch SGD reference (no ZeRO, every rank's rows at once)."""
from typing import Dict, List, Optional, Tuple

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


class FP32MasterSGD:
    """Plain SGD stepping fp32 masters of ``params`` and copying them back into the params, as
    deepspeed's ZeRO optimizer does; in fp32 throughout it is plain SGD."""

    def __init__(self, params, lr: float):
        self.params = list(params)
        self.masters = [param.detach().float().clone().requires_grad_() for param in self.params]
        self.optimizer = torch.optim.SGD(self.masters, lr=lr)

    def step(self, grad_scale: float = 1.0, skip: bool = False) -> None:
        """Each param's gradient, divided by ``grad_scale`` (a loss scale), onto its master; a step
        unless ``skip`` (a step deepspeed's fp16 loss scaler skipped); the masters copied back."""
        for master, param in zip(self.masters, self.params):
            master.grad, param.grad = param.grad.float() / grad_scale, None
        if not skip:
            self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for master, param in zip(self.masters, self.params):
                param.copy_(master)


def sgd_reference(model: nn.Module, rows: Tuple[torch.Tensor, torch.Tensor], steps: int, lr: float,
                  trainable_dtype: Optional[torch.dtype] = None) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """``steps`` of SGD over fp32 masters of the trainable params (cast to ``trainable_dtype``
    first, as deepspeed before 0.19.2 casts fp32 adapters into a bf16 engine) on ``rows``
    (inputs, targets): the loss per step and each trainable param's master at the end."""
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if trainable_dtype is not None:
        for _, param in trainable:
            param.data = param.data.to(trainable_dtype)
    optimizer = FP32MasterSGD([param for _, param in trainable], lr)
    x, target = rows
    losses = []
    for _ in range(steps):
        loss = model(x, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: master.detach().clone() for (name, _), master in zip(trainable, optimizer.masters)}
