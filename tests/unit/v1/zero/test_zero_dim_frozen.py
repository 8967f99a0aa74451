"""A frozen 0-dim param (a scale, a temperature) inside a checkpointed block, on 2 ranks, under
every policy: the recompute's release must leave it something of its shape, () included.

The scale's module sits between two trainable Linears, so autograd saves the scale and the
non-reentrant checkpoint keeps the very Parameter; the last Linear's backward starts the
recompute, and under ``release`` the recompute's release of the scale's module gives the scale
a placeholder. Losses and the trained values against plain torch (tests/unit/v1/zero/
plain_torch.py), nothing gathered after any step.

Mutation: the placeholder built with ``cell.expand(param.ds_shape)`` over the one-element cell
(what landed until this test) raises under ``release``: "the number of sizes provided (0) must be
greater or equal to the number of dimensions in the tensor (1)".
"""
import traceback

import pytest
import torch
import torch.nn as nn

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.plain_torch import CheckpointedChain, sgd_reference

DIM = 8
BLOCKS = 2
STEPS = 3
LR = 0.1


class _Scale(nn.Module):
    """A frozen 0-dim param, multiplied in: autograd saves it when the input needs grad."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.75), requires_grad=False)

    def forward(self, x):
        return x * self.scale


class _ScaledBlock(nn.Module):
    """first (trainable), the scale, last (trainable): last's backward starts the recompute, which
    releases the scale's module before its backward, the release that gets a placeholder."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.scale = _Scale()
        self.last = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.last(self.scale(torch.tanh(self.first(x))))


def _build(checkpointing: bool) -> CheckpointedChain:
    torch.manual_seed(0)
    return CheckpointedChain([_ScaledBlock() for _ in range(BLOCKS)], checkpointing)


def _engine(model):
    """The SGD engine, or a skip where deepspeed itself cannot take a 0-dim param."""
    import deepspeed

    from tests.unit.v1.zero.scenario_runner import sgd_engine

    try:
        return sgd_engine(model, LR)
    except RuntimeError as error:
        # deepspeed 0.19.8 broadcasts every param's partition in _broadcast_model and fails on a
        # 0-dim one before any step: deepspeed's, not this package's.
        if "_broadcast_model" in "".join(traceback.format_tb(error.__traceback__)):
            pytest.skip(f"deepspeed {deepspeed.__version__} cannot initialize a 0-dim param: {error}")
        raise


class TestZeroDimFrozenParam(DistributedTest):
    world_size = 2
    timeout = 180

    @pytest.mark.parametrize("policy", ["auto", "keep", "release"])
    def test_trains_as_plain_torch(self, policy):
        import deepspeed.comm as dist

        from tests.unit.patch_switch import policy_in_force
        from tests.unit.v1.zero.scenario_runner import (assert_trained_as, device, gathered_trainable, local_rows,
                                                        random_rows, train_mean_losses)

        rows = random_rows(DIM, dist.get_world_size())
        expected = sgd_reference(_build(checkpointing=True), rows, STEPS, LR)
        with policy_in_force(policy):
            engine = _engine(_build(checkpointing=True))
            x, target = (local_rows(tensor).to(device()) for tensor in rows)
            losses = train_mean_losses(engine, x, target, STEPS)
            assert_trained_as(expected, losses, gathered_trainable(engine.module), f"{policy}: ")
