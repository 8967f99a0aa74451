"""Small models for the recompute scenario matrix: every way a frozen param meets a checkpoint.

Each model's forward takes (inputs, target) and returns a scalar loss that is a mean over the
batch rows, so the mean of the ranks' losses equals the loss of one run over all their rows.
Frozen params get non-trivial values, so a wrong (e.g. shrunk or stale) frozen weight shows in
the loss.
"""
from typing import Callable, Iterable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from zero3_recompute.testing.frozen_blocks import FrozenNormLinear

DIM = 16
VOCAB = 24
SEQ = 3

# Wrap: how a model runs one block: wrap(block, x) -> output.
Wrap = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def mse_loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error, in fp32 for half-precision inputs, as HF computes its losses
    (torch 2.4's CPU has no bf16 or fp16 mse kernel)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return F.mse_loss(x.float(), target.float())
    return F.mse_loss(x, target)


def torch_checkpoint(use_reentrant: bool) -> Wrap:

    def wrap(block, x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)

    return wrap


def torch_checkpoint_of_forward(use_reentrant: bool) -> Wrap:
    """Checkpoint block.forward, not block.__call__: the block's own ZeRO hooks run outside it."""

    def wrap(block, x):
        return torch.utils.checkpoint.checkpoint(block.forward, x, use_reentrant=use_reentrant)

    return wrap


def torch_checkpoint_early_stop_off(block, x):
    """checkpoint(..., early_stop=False) per call (torch 2.13 on), not the global context manager."""
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, early_stop=False)


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective-checkpoint policy: keep matmul outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def torch_selective_checkpoint(block, x):
    """Selective activation checkpointing (torch 2.5 on): context_fn from
    create_selective_checkpoint_contexts, matmul outputs saved, the norms recomputed."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                             context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls))


def deepspeed_checkpoint(block, x):
    import deepspeed

    return deepspeed.checkpointing.checkpoint(block, x)


def deepspeed_non_reentrant_checkpoint(block, x):
    import deepspeed

    return deepspeed.checkpointing.non_reentrant_checkpoint(block, x)


def no_checkpoint(block, x):
    return block(x)


def perturb_frozen(model: nn.Module) -> nn.Module:
    """Give every frozen param values that a default init would not (ones, zeros)."""
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad:
                param.uniform_(0.5, 1.5) if param.dim() == 1 else param.normal_(0.0, 0.3)
    return model


class TrainableThenFrozen(nn.Module):
    """A trainable Linear, then a frozen Linear: the block's last module is frozen-only, so its
    own backward is what triggers the recompute."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.trainable = nn.Linear(dim, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(torch.tanh(self.trainable(x)))


class TrainableThenFrozenNorm(nn.Module):
    """A trainable Linear, then a frozen LayerNorm: the block's last module is frozen-only, so
    its own backward is what triggers the recompute. LayerNorm keeps its weight itself for
    backward (Linear keeps a transposed view), so a shrunk weight shows."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.trainable = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.norm.requires_grad_(False)

    def forward(self, x):
        return self.norm(torch.tanh(self.trainable(x)))


class FrozenSandwich(nn.Module):
    """Frozen LayerNorm, frozen Linear, trainable Linear."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.frozen = nn.Linear(dim, dim)
        self.trainable = nn.Linear(dim, dim)
        self.norm.requires_grad_(False)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.trainable(torch.tanh(self.frozen(self.norm(x))))


class TwoNormBlock(nn.Module):
    """A frozen LayerNorm over ``dim`` and one over ``wide``: with a persistence threshold in
    between, the first stays resident and the second is partitioned."""

    def __init__(self, dim: int = DIM, wide: int = 8 * DIM):
        super().__init__()
        self.narrow_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, wide)
        self.wide_norm = nn.LayerNorm(wide)
        self.down = nn.Linear(wide, dim)
        self.narrow_norm.requires_grad_(False)
        self.wide_norm.requires_grad_(False)

    def forward(self, x):
        return self.down(self.wide_norm(self.up(self.narrow_norm(x))))


def pair(dim: int = DIM) -> nn.Sequential:
    """Two frozen-norm blocks in a Sequential: deepspeed never makes a container a leaf module."""
    return nn.Sequential(FrozenNormLinear(dim), FrozenNormLinear(dim))


class Chain(nn.Module):
    """Blocks run one after another through ``wrap`` (or each through its own of ``wraps``);
    MSE against the target."""

    def __init__(self, blocks: Iterable[nn.Module], wrap: Wrap, wraps: Optional[List[Wrap]] = None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.wraps = wraps or [wrap] * len(self.blocks)

    def forward(self, x, target):
        for block, wrap in zip(self.blocks, self.wraps):
            x = wrap(block, x)
        return mse_loss(x, target)


class GainedChain(Chain):
    """A Chain whose root has a param of its own, read after every block: a frozen gain on the
    output (frozen: a gradient in ZeRO's reduction bucket before a fault is more than stock
    deepspeed recovers from)."""

    def __init__(self, blocks: Iterable[nn.Module], wrap: Wrap):
        super().__init__(blocks, wrap)
        self.gain = nn.Parameter(torch.ones(DIM) + 0.1 * torch.randn(DIM), requires_grad=False)

    def forward(self, x, target):
        for block, wrap in zip(self.blocks, self.wraps):
            x = wrap(block, x)
        return mse_loss(x * self.gain, target)


class NestedPair(nn.Module):
    """Two blocks, each checkpointed inside this one (which is itself checkpointed by its parent)."""

    def __init__(self, inner_wrap: Wrap, dim: int = DIM):
        super().__init__()
        self.first = FrozenNormLinear(dim)
        self.second = FrozenNormLinear(dim)
        self.inner_wrap = inner_wrap

    def forward(self, x):
        return self.inner_wrap(self.second, self.inner_wrap(self.first, x))


class SharedTwice(nn.Module):
    """The same block applied twice in one forward."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.shared = FrozenNormLinear(dim)

    def forward(self, x):
        return self.shared(torch.tanh(self.shared(x)))


class Recursive(nn.Module):
    """Calls itself ``depth`` times; each level runs its frozen-norm block."""

    def __init__(self, depth: int = 2, dim: int = DIM):
        super().__init__()
        self.depth = depth
        self.block = FrozenNormLinear(dim)

    def forward(self, x, level: int = 0):
        x = torch.tanh(self.block(x))
        return x if level == self.depth else self(x, level + 1)


class KeywordOnly(nn.Module):
    """Calls its submodules with keyword arguments only, as Llama calls self_attn. ZeRO attaches
    a module's backward release to its positional inputs, so these never get one."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.inner = KeywordBlock(dim)

    def forward(self, x):
        return self.inner(hidden=x)


class KeywordBlock(FrozenNormLinear):
    """FrozenNormLinear whose input has a name to be passed by: ``block(hidden=x)``."""

    def __init__(self, dim: int = DIM):
        super().__init__(dim)

    def forward(self, hidden):
        return super().forward(hidden)


class Gated(nn.Module):
    """Uses a child's frozen weight without calling the child: an external parameter."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.block = FrozenNormLinear(dim)
        self.gate_owner = nn.Linear(dim, dim, bias=False)
        self.gate_owner.requires_grad_(False)

    def register(self) -> None:
        """deepspeed.zero.register_external_parameter, as its docs ask; needs ZeRO-3 params."""
        import deepspeed

        deepspeed.zero.register_external_parameter(self, self.gate_owner.weight)

    def forward(self, x):
        return self.block(x) * torch.sigmoid(self.gate_owner.weight.sum(dim=0))


class FaultyBlock(FrozenNormLinear):
    """Raises InjectedFault in its recompute (inside a backward graph task) when armed."""

    def __init__(self, dim: int = DIM):
        super().__init__(dim)
        self.armed = False

    def forward(self, x):
        if self.armed and torch._C._current_graph_task_id() != -1:
            self.armed = False
            raise InjectedFault("injected fault in a checkpoint recompute")
        return super().forward(x)


class FrozenBlock(nn.Module):
    """Only frozen params: its backward reduces no gradient."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)
        self.requires_grad_(False)

    def forward(self, x):
        return self.linear(self.norm(x))


class CallAtBackward(torch.autograd.Function):
    """Identity; its backward calls ``owner.on_backward()`` where one is set."""

    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.owner.on_backward is not None:
            ctx.owner.on_backward()
        return grad, None


class PausingBlock(nn.Module):
    """Frozen LayerNorm -> pause -> trainable Linear. The pause's backward calls ``on_backward``
    in the middle of the model's backward: after a checkpointed block's recompute gathered the
    norm, before the norm's backward uses it (test_concurrency, test_backward_footprint)."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.norm.requires_grad_(False)
        self.linear = nn.Linear(dim, dim)
        self.on_backward = None

    def forward(self, x):
        return self.linear(CallAtBackward.apply(self.norm(x), self))


class InjectedFault(RuntimeError):
    pass


class TokenModel(nn.Module):
    """Frozen embedding -> checkpointed blocks -> head, cross-entropy over tokens.

    The blocks' input needs no grad (no enable_input_require_grads). With ``tie_head`` the head
    is the embedding's frozen weight and is checkpointed too, and a trainable bias is added
    before it so there is something to train downstream of the blocks.
    """

    def __init__(self, blocks: Iterable[nn.Module], wrap: Wrap, tie_head: bool, dim: int = DIM,
                 vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.shift = nn.Parameter(torch.zeros(dim))
        if tie_head:
            self.head.weight = self.embed.weight
        self.tie_head = tie_head
        self.wrap = wrap

    def forward(self, ids, target):
        x = self.embed(ids)
        for block in self.blocks:
            x = self.wrap(block, x)
        x = x + self.shift
        logits = self.wrap(self.head, x) if self.tie_head else self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class WideTop(Chain):
    """A Chain with a large direct parameter, so that deepspeed's granularity-threshold leaf
    selection picks the blocks, not the whole model, as ZeRO-3 leaf modules."""

    def __init__(self, blocks: Iterable[nn.Module], wrap: Wrap, top_numel: int = 1024):
        super().__init__(blocks, wrap)
        self.top = nn.Parameter(torch.ones(top_numel), requires_grad=False)

    def forward(self, x, target):
        return super().forward(x, target) * self.top[0]
