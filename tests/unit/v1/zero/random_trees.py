"""Seeded random module trees for the differential test.

A tree is a nest of Sequence nodes over LayerNorm and Linear leaves. Each child of a Sequence
is run plainly or through torch's checkpoint (reentrant or not); frozen masks are drawn per
parameter; the dtype is drawn from those the accelerator supports. The same seed always gives
the same tree, and describe() prints it.
"""
import random
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint

from tests.unit.v1.zero.scenario_models import mse_loss

DIM = 8
WRAPS = ("plain", "non-reentrant", "reentrant")


class Sequence(nn.Module):
    """Runs its children in order, each as its wrap says, with tanh in between."""

    def __init__(self, children: List[nn.Module], wraps: List[str]):
        super().__init__()
        self.steps = nn.ModuleList(children)
        self.wraps = list(wraps)

    def forward(self, x):
        for child, wrap in zip(self.steps, self.wraps):
            if wrap == "plain":
                x = child(x)
            else:
                x = torch.utils.checkpoint.checkpoint(child, x, use_reentrant=wrap == "reentrant")
            x = torch.tanh(x)
        return x


class Tree(nn.Module):

    def __init__(self, root: nn.Module):
        super().__init__()
        self.root = root

    def forward(self, x, target):
        return mse_loss(self.root(x), target)


@dataclass(frozen=True)
class TreeCase:
    seed: int
    dtype: torch.dtype
    input_grad: bool

    def build(self) -> Tree:
        """The tree, its weights and frozen mask, drawn from ``seed``; same on every call."""
        draw = random.Random(self.seed)
        torch.manual_seed(self.seed)
        tree = Tree(_node(draw, depth=draw.randint(1, 3)))
        params = list(tree.parameters())
        frozen = [draw.random() < 0.5 for _ in params]
        frozen[draw.randrange(len(params))] = True
        frozen[draw.randrange(len(params))] = False
        with torch.no_grad():
            for param, is_frozen in zip(params, frozen):
                param.requires_grad_(not is_frozen)
                if is_frozen:
                    param.uniform_(0.5, 1.5) if param.dim() == 1 else param.normal_(0.0, 0.4)
        return tree

    @property
    def checkpointed(self) -> bool:
        """Whether any part of the tree runs under a checkpoint. A tree that none does trains as on
        stock under the package (NOTE [ Parameter lifecycle under recompute ], last paragraph):
        what a backward release never reaches stays gathered until step()."""
        return any(wrap != "plain" for module in self.build().modules() if isinstance(module, Sequence)
                   for wrap in module.wraps)

    def describe(self) -> str:
        tree = self.build()
        lines = [f"tree seed {self.seed}: dtype {str(self.dtype).replace('torch.', '')}, "
                 f"input requires grad: {self.input_grad}"]
        _describe(tree.root, "root", "", lines)
        return "\n".join(lines)


def _node(draw: random.Random, depth: int) -> nn.Module:
    if depth == 0:
        return nn.LayerNorm(DIM) if draw.random() < 0.4 else nn.Linear(DIM, DIM, bias=draw.random() < 0.7)
    count = draw.randint(1, 3)
    children = [_node(draw, depth - 1 if draw.random() < 0.7 else 0) for _ in range(count)]
    wraps = [draw.choice(WRAPS) for _ in children]
    return Sequence(children, wraps)


def _describe(module: nn.Module, name: str, indent: str, lines: List[str]) -> None:
    frozen = "".join("F" if not p.requires_grad else "T" for p in module.parameters(recurse=False))
    lines.append(f"{indent}{name}: {type(module).__name__}{f' [{frozen}]' if frozen else ''}")
    if isinstance(module, Sequence):
        for index, (child, wrap) in enumerate(zip(module.steps, module.wraps)):
            _describe(child, f"{index} ({wrap})", indent + "  ", lines)


def case(seed: int, dtypes: List[torch.dtype]) -> TreeCase:
    """The seed's case. The input needs grad unless the draw says otherwise and the loss still
    reaches a trainable param without it (a tree whose loss needs no grad cannot train)."""
    draw = random.Random(seed * 7919 + 1)
    dtype = draw.choice(dtypes)
    input_grad = draw.random() < 0.5
    if not input_grad and not _trains_without_input_grad(TreeCase(seed, torch.float32, False)):
        input_grad = True
    return TreeCase(seed, dtype, input_grad)


def _trains_without_input_grad(tree_case: TreeCase) -> bool:
    tree = tree_case.build()
    x = torch.randn(2, DIM)
    return tree(x, torch.zeros(2, DIM)).requires_grad


def supported_dtypes(fp16: Optional[bool] = None) -> List[torch.dtype]:
    from deepspeed.accelerator import get_accelerator

    dtypes = [torch.float32, torch.bfloat16]
    if fp16 if fp16 is not None else get_accelerator().is_fp16_supported():
        dtypes.append(torch.float16)
    return dtypes
