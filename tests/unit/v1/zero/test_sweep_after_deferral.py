"""The end-of-backward sweep gives a deferred module its missed backward release, on every
deepspeed, under release (NOTE [ Parameter lifecycle under recompute ], steps 2 and 3).

The model runs a trainable Linear, then a frozen Linear called with keyword arguments only, in a
checkpoint of its own directly under the root: ZeRO counts no input of it, so its backward release
never fires, and the root's backward release, which comes last, gives it that release late. Under
release its backward fetch is deferred to the recompute, so deepspeed 0.19.3+ never records it
among the coordinator's active backward submodules. Trains as plain torch, nothing gathered after
a step, under every policy.

Mutation: the late releases after the root's own (as in 1dd7ac1): on 0.19.3+ the frozen Linear's
finds the active-backward record empty and raises "active_backward_submodules is empty during
backward pass", under release.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.plain_torch import sgd_reference

DIM = 8
STEPS = 3
LR = 0.1


class _Model(nn.Module):
    """A trainable Linear, then a frozen Linear called by keyword in a checkpoint of its own,
    directly under the root: only the root's backward release can give it its own."""

    def __init__(self, checkpointing: bool):
        super().__init__()
        self.checkpointing = checkpointing
        self.trainable = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)

    def _frozen_by_keyword(self, x):
        return self.frozen(input=x)

    def forward(self, x, target):
        x = torch.tanh(self.trainable(x))
        if self.checkpointing:
            x = torch.utils.checkpoint.checkpoint(self._frozen_by_keyword, x, use_reentrant=False)
        else:
            x = self._frozen_by_keyword(x)
        return F.mse_loss(x, target)


class TestSweepAfterDeferral(DistributedTest):
    world_size = 2
    timeout = 180

    @pytest.mark.parametrize("policy", ["auto", "keep", "release"])
    def test_trains_as_plain_torch(self, policy):
        import deepspeed.comm as dist

        import zero3_recompute
        from tests.unit.patch_switch import policy_in_force
        from tests.unit.v1.zero.scenario_runner import (assert_trained_as, device, gathered_trainable, local_rows,
                                                        random_rows, sgd_engine, train_mean_losses)

        if not zero3_recompute.status().active:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        rows = random_rows(DIM, dist.get_world_size())
        torch.manual_seed(0)
        expected = sgd_reference(_Model(checkpointing=False), rows, STEPS, LR)
        with policy_in_force(policy):
            torch.manual_seed(0)
            engine = sgd_engine(_Model(checkpointing=True), LR)
            x, target = (local_rows(tensor).to(device()) for tensor in rows)
            x.requires_grad_(True)  # the root's backward release fires
            losses = train_mean_losses(engine, x, target, STEPS)
            assert_trained_as(expected, losses, gathered_trainable(engine.module), f"{policy}: ")
