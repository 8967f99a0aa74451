"""A frozen module whose autograd Function keeps its Parameter on ctx, outside save_for_backward,
and reads it in backward: it trains under every policy, with gradients equal to plain torch's.

bitsandbytes' 4-bit matmul keeps the weight so (ctx.tensors); here a Function of our own keeps
the Parameter object itself. A checkpointed block runs a trainable Linear, then that frozen
module, so the frozen module's backward comes first in the block, before any recompute. Its
Function saved nothing through autograd, so its backward starts no recompute: it reads ctx.weight
right after the module's backward fetch. Under release, a fetch deferred to the coming
recompute (NOTE [ Deferred fetch ]) would leave that read the
partitioned tensor; NOTE [ Params read outside saved tensors ] keeps such a module's fetch.

Mutation: the deferral taken regardless (zero3_recompute.autograd_reads finding no such
Function): under release the Function's backward multiplies by a partitioned weight and raises.
"""
import pytest
import torch
import torch.nn as nn

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.plain_torch import CheckpointedChain, sgd_reference
from tests.unit.v1.zero.scenario_models import DIM

STEPS = 3
LR = 0.1


class _KeepsParameterOnContext(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight  # the Parameter itself, which ZeRO-3 partitions after the forward
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.weight, None


class _ContextLinear(nn.Module):

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5, requires_grad=False)

    def forward(self, x):
        return _KeepsParameterOnContext.apply(x, self.weight)


class _Block(nn.Module):

    def __init__(self):
        super().__init__()
        self.trainable = nn.Linear(DIM, DIM)
        self.frozen = _ContextLinear()

    def forward(self, x):
        return self.frozen(torch.tanh(self.trainable(x)))


def _model(checkpointing: bool) -> CheckpointedChain:
    return CheckpointedChain([_Block() for _ in range(2)], checkpointing)


def _rows():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, DIM, generator=generator), torch.randn(8, DIM, generator=generator)


def _reference():
    """Plain torch, no checkpointing: the loss per step and the trainable params at the end."""
    torch.manual_seed(0)
    return sgd_reference(_model(checkpointing=False), _rows(), STEPS, LR)


def _train():
    from tests.unit.v1.zero.scenario_runner import (device, gathered_trainable, local_rows, sgd_engine,
                                                    train_mean_losses)

    torch.manual_seed(0)
    engine = sgd_engine(_model(checkpointing=True), LR)
    x, target = (local_rows(tensor).to(device()) for tensor in _rows())
    losses = train_mean_losses(engine, x, target, STEPS)
    return losses, gathered_trainable(engine.module)


class TestParamsKeptOnContext(DistributedTest):
    world_size = 2
    timeout = 180

    @pytest.mark.parametrize("policy", ["auto", "keep", "release"])
    def test_trains_as_plain_torch(self, policy):
        import zero3_recompute
        from tests.unit.patch_switch import policy_in_force
        from tests.unit.v1.zero.scenario_runner import assert_trained_as

        if not zero3_recompute.status().fixed:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        expected = _reference()
        with policy_in_force(policy):
            losses, values = _train()
        assert_trained_as(expected, losses, values, f"{policy}, {STEPS} SGD steps: ")
