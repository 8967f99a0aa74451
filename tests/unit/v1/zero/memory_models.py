"""LLM-shaped LoRA stacks for the memory contract, in every shape the contract names.

A block is RMSNorm -> attention (q, k, v, o; LoRA on q and v) -> RMSNorm -> MLP (up, down),
with residuals; every base weight and norm is frozen, only LoRA's A and B train. RMSNorm
multiplies by its weight, so autograd saves the frozen weight itself: the crash's trigger.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from zero3_recompute.testing.workloads import LoRAProjection, frozen_linear

DIM = 32
SEQ = 4
RANK = 4
VOCAB = 48


class RMSNorm(nn.Module):

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, hidden):
        return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    """Single-head attention. Self-attention: LoRA on q and v. Cross-attention (``cross``):
    LoRA on q only, so k and v over a context that needs no grad make outputs that need none."""

    def __init__(self, cross: bool = False, dim: int = DIM):
        super().__init__()
        self.q_proj = LoRAProjection(dim, dim, rank=RANK)
        self.k_proj = frozen_linear(dim, dim)
        self.v_proj = frozen_linear(dim, dim) if cross else LoRAProjection(dim, dim, rank=RANK)
        self.o_proj = frozen_linear(dim, dim)

    def forward(self, hidden, context=None):
        source = hidden if context is None else context
        q, k, v = self.q_proj(hidden), self.k_proj(source), self.v_proj(source)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1]**0.5, dim=-1)
        return self.o_proj(weights @ v)


class MLP(nn.Module):

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.up_proj = frozen_linear(dim, 2 * dim)
        self.down_proj = frozen_linear(2 * dim, dim)

    def forward(self, hidden):
        return self.down_proj(F.gelu(self.up_proj(hidden)))


class Block(nn.Module):
    """``keyword_only``: norms, attention and MLP are called with keyword arguments only, as
    Llama calls self_attn; ZeRO then never gives them a backward release. ``cross``: a
    cross-attention over the context follows self-attention."""

    def __init__(self, keyword_only: bool = False, cross: bool = False, dim: int = DIM):
        super().__init__()
        self.keyword_only = keyword_only
        self.input_norm = RMSNorm(dim)
        self.self_attn = Attention(dim=dim)
        self.cross_norm = RMSNorm(dim) if cross else None
        self.cross_attn = Attention(cross=True, dim=dim) if cross else None
        self.post_norm = RMSNorm(dim)
        self.mlp = MLP(dim)

    def _call(self, module, hidden):
        return module(hidden=hidden) if self.keyword_only else module(hidden)

    def forward(self, x, context=None):
        x = x + self._call(self.self_attn, self._call(self.input_norm, x))
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.cross_norm(x), context)
        return x + self._call(self.mlp, self._call(self.post_norm, x))


@dataclass(frozen=True)
class Shape:
    name: str
    placement: str = "call"  # "call": checkpoint(block, ...), hooks inside; "forward": checkpoint(block.forward, ...)
    keyword_only: bool = False
    cross: bool = False
    tokens: bool = False  # a frozen embedding feeds the first block
    gas: int = 1


SHAPES = [
    Shape("lora"),
    Shape("lora_hooks_outside", placement="forward"),
    Shape("keyword_only", keyword_only=True),
    Shape("cross_attention", cross=True),
    Shape("frozen_embedding", tokens=True, gas=2),
]
BY_NAME = {shape.name: shape for shape in SHAPES}


class Stack(nn.Module):
    """``depth`` blocks, each run through ``checkpointing`` (None, "reentrant", "non_reentrant");
    mean squared error against the target. Inputs: hidden states that need grad, or token ids
    through a frozen embedding (whose output needs grad only under reentrant checkpointing, as
    HF's enable_input_require_grads makes it)."""

    def __init__(self, shape: Shape, depth: int, checkpointing: Optional[str]):
        super().__init__()
        self.shape = shape
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(VOCAB, DIM).requires_grad_(False) if shape.tokens else None
        self.blocks = nn.ModuleList(Block(shape.keyword_only, shape.cross) for _ in range(depth))

    def _run(self, block, x, context):
        if self.checkpointing is None:
            return block(x, context)
        function = block if self.shape.placement == "call" else block.forward
        return torch.utils.checkpoint.checkpoint(function, x, context,
                                                 use_reentrant=self.checkpointing == "reentrant")

    def forward(self, inputs, target, context=None):
        x = inputs
        if self.embed is not None:
            x = self.embed(inputs)
            if self.checkpointing == "reentrant":
                x.requires_grad_(True)
        for block in self.blocks:
            x = self._run(block, x, context)
        return F.mse_loss(x, target)


def build(shape: Shape, depth: int, checkpointing: Optional[str], seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    model = Stack(shape, depth, checkpointing)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(0.0, 0.1)  # PEFT starts B at zero; non-zero makes A's grad non-zero
            elif not param.requires_grad and param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model


def batch(shape: Shape, step: int, micro: int, rows: int):
    """(inputs, target, context) for one micro-batch, the same on every rank."""
    generator = torch.Generator().manual_seed(7_000 + 10 * step + micro)
    if shape.tokens:
        inputs = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    else:
        inputs = torch.randn(rows, SEQ, DIM, generator=generator).requires_grad_()
    target = torch.randn(rows, SEQ, DIM, generator=generator)
    context = torch.randn(rows, SEQ, DIM, generator=generator) if shape.cross else None
    return inputs, target, context


def block_trainable_bytes(model: Stack) -> int:
    return sum(param.ds_numel * param.element_size() for param in model.blocks[0].parameters() if param.requires_grad)


def block_frozen_bytes(model: Stack) -> int:
    """One block's frozen params, in bytes of their full (gathered) size."""
    return sum(param.ds_numel * param.element_size() for param in model.blocks[0].parameters()
               if not param.requires_grad)
