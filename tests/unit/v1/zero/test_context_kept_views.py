"""A frozen module whose autograd Function keeps a view of the gathered weight on its ctx, outside
save_for_backward, as bitsandbytes' 4-bit matmul does (ctx.tensors = (None, weight.t())).

Under a non-reentrant checkpoint that ctx is the original forward's: on stock the view keeps
every block's gathered weight alive from forward to the end of backward, growing with depth,
while ZeRO says partitioned. NOTE [ Gathered storage kept outside saved tensors ] frees such a
storage in place at the release and refills it at the next fetch. Checked at 2 and 4 blocks, by
the live storage of frozen params during backward (GatheredMemory.peak_backward_live_frozen,
prefetch off: exact bytes): under every policy it is flat in depth and at most one block's frozen
weight above the frozen bytes gathered (status AVAILABLE), while stock's grows by one block per
block; losses and trained values equal plain torch's, nothing gathered after a step.

A module that also returns a view of its weight (as a positional embedding returns a slice of
its table), which its caller reads after the release, trains as plain torch does: its storage is
left alone. With one rank deepspeed gathers nothing: the param views its own partition, which must never be
freed; that run trains as plain torch does.

Mutations: the free left out (KeptStorage.after_release keeps every storage) fails the flatness
check; the refill left out (KeptStorage.after_fetch does nothing) makes the Function's backward
raise ("setStorage: ... out of bounds for storage of size 0"); the partition taken in (the
ds_tensor check in kept_storage._candidate left out) gives the one-rank run a nan loss at step 2;
the returned storages not excluded (``returned`` check in _candidate left out) makes the caller
of the row-returning module read freed memory.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.context_views import ViewLinear
from tests.unit.v1.zero.plain_torch import sgd_reference
from tests.unit.v1.zero.scenario_models import DIM

STEPS = 2
LR = 0.1
DEPTHS = (2, 4)
FROZEN_BLOCK_BYTES = DIM * DIM * 4


class _ViewLinear(ViewLinear):

    def __init__(self):
        super().__init__(DIM)


class _ViewLinearAndRow(_ViewLinear):
    """Also returns a view of its weight's first row, which the caller reads after the release,
    as a positional embedding returns a slice of its table."""

    def forward(self, x):
        return super().forward(x), self.weight[0]


class _Block(nn.Module):

    def __init__(self, returns_row: bool = False):
        super().__init__()
        self.trainable = nn.Linear(DIM, DIM)
        self.frozen = _ViewLinearAndRow() if returns_row else _ViewLinear()

    def forward(self, x):
        out = self.frozen(torch.tanh(self.trainable(x)))
        if isinstance(out, tuple):
            out = out[0] + out[1]
        return torch.tanh(out)


class _Model(nn.Module):

    def __init__(self, blocks: int, checkpointing: bool, returns_row: bool = False):
        super().__init__()
        self.checkpointing = checkpointing
        self.blocks = nn.ModuleList(_Block(returns_row) for _ in range(blocks))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return F.mse_loss(x, target)


def _reference(blocks: int, ranks: int, returns_row: bool = False):
    """Plain torch, no checkpointing, on every rank's rows: the loss per step and the trainable
    params at the end."""
    from tests.unit.v1.zero.scenario_runner import random_rows

    torch.manual_seed(0)
    return sgd_reference(_Model(blocks, checkpointing=False, returns_row=returns_row), random_rows(DIM, ranks), STEPS,
                         LR)


def _train(blocks: int, returns_row: bool = False):
    """ZeRO-3 with every block checkpointed: (losses, trained values, live frozen peak, gathered
    frozen peak), both peaks in backward."""
    import deepspeed.comm as dist

    from tests.unit.v1.zero.scenario_runner import (device, gathered_trainable, local_rows, random_rows, sgd_engine,
                                                    train_mean_losses)
    from zero3_recompute.testing.probes import GatheredMemory

    torch.manual_seed(0)
    engine = sgd_engine(_Model(blocks, checkpointing=True, returns_row=returns_row), LR)
    x, target = (local_rows(tensor).to(device()) for tensor in random_rows(DIM, dist.get_world_size()))
    memory = GatheredMemory(engine.module)
    try:
        losses = train_mean_losses(engine, x, target, STEPS)
    finally:
        memory.close()
    return losses, gathered_trainable(engine.module), memory.peak_backward_live_frozen, memory.peak_backward_frozen


def _assert_as_plain_torch(blocks: int, losses, values, returns_row: bool = False) -> None:
    import deepspeed.comm as dist

    from tests.unit.v1.zero.scenario_runner import assert_trained_as

    assert_trained_as(_reference(blocks, dist.get_world_size(), returns_row), losses, values,
                      f"{blocks} blocks, {STEPS} SGD steps: ")


class TestViewsKeptOnContext(DistributedTest):
    world_size = 2
    timeout = 240

    def test_stock_keeps_every_block(self):
        """The premise: on stock, the kept views hold one more block's weight per block."""
        from tests.unit.patch_switch import patch_reverted

        with patch_reverted():
            live = {blocks: _train(blocks)[2] for blocks in DEPTHS}
        assert live[DEPTHS[1]] - live[DEPTHS[0]] == (DEPTHS[1] - DEPTHS[0]) * FROZEN_BLOCK_BYTES, \
            f"stock's live frozen storage in backward: {live}; expected one block ({FROZEN_BLOCK_BYTES} B) more per block"

    @pytest.mark.parametrize("policy", ["auto", "keep", "release"])
    def test_freed_until_fetched(self, policy):
        import zero3_recompute
        from tests.unit.patch_switch import policy_in_force

        status = zero3_recompute.status()
        if not status.active:
            pytest.skip(f"the package is not patched here: {status}")
        runs = {}
        with policy_in_force(policy):
            for blocks in DEPTHS:
                losses, values, live, gathered = _train(blocks)
                _assert_as_plain_torch(blocks, losses, values)
                runs[blocks] = (live, gathered)
        shallow, deep = (runs[blocks] for blocks in DEPTHS)
        assert shallow[0] == deep[0], f"live frozen storage in backward grows with depth: {runs} ((live, gathered) B)"
        for blocks, (live, gathered) in runs.items():
            assert live <= gathered + FROZEN_BLOCK_BYTES, \
                f"{blocks} blocks: live frozen {live} B > gathered frozen {gathered} B + one block {FROZEN_BLOCK_BYTES} B"

    def test_returned_view_left_alone(self):
        """A module that also returns a view of its weight keeps its storage as stock does."""
        import zero3_recompute

        status = zero3_recompute.status()
        if not status.active:
            pytest.skip(f"the package is not patched here: {status}")
        blocks = DEPTHS[0]
        losses, values, _, _ = _train(blocks, returns_row=True)
        _assert_as_plain_torch(blocks, losses, values, returns_row=True)


    def test_revert_refused_before_backward(self):
        """revert() between a forward and its backward would leave the backward reading storage the
        package freed: it is refused, nothing changed; after the backward it reverts. Mutation: the
        refusal left out (patch._unpatch) fails it: revert() goes through."""
        import deepspeed.comm as dist

        import zero3_recompute
        from tests.unit.v1.zero.scenario_runner import device, local_rows, random_rows, sgd_engine
        from zero3_recompute.errors import RevertRefused

        status = zero3_recompute.status()
        if not status.active or not status.frees_kept_storage:
            pytest.skip(f"kept storage is not freed here: {status}")
        torch.manual_seed(0)
        engine = sgd_engine(_Model(DEPTHS[0], checkpointing=True), LR)
        x, target = (local_rows(tensor).to(device()) for tensor in random_rows(DIM, dist.get_world_size()))
        try:
            loss = engine(x, target)
            with pytest.raises(RevertRefused, match=r"expected no graph still referencing .* got 2 such storages"):
                zero3_recompute.revert()
            assert zero3_recompute.status().active, "a refused revert() changed something"
            engine.backward(loss)
            engine.step()
            del loss
            assert not zero3_recompute.revert().active
        finally:
            zero3_recompute.apply(policy=status.policy)


class TestViewsKeptOnContextOneRank(DistributedTest):
    world_size = 1
    timeout = 180

    def test_partition_left_alone(self):
        import zero3_recompute

        status = zero3_recompute.status()
        if not status.active:
            pytest.skip(f"the package is not patched here: {status}")
        blocks = DEPTHS[0]
        losses, values, _, _ = _train(blocks)
        _assert_as_plain_torch(blocks, losses, values)
