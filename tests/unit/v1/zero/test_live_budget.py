"""Holds within stage3_max_live_parameters (NOTE [ Holds within the live-parameter limit ]).

A checkpointed block of FROZEN frozen Linears and a trainable Linear, non-reentrant, 2 ranks,
prefetch and reuse distance 0. With the limit at 1.5 frozen modules' numel, the frozen bytes
gathered in backward stay within 2.5 modules' worth (the limit plus the module being run), under
auto and keep; with the live_budget layer off, every frozen module is held (FROZEN modules'
worth). Each run trains as the same model without checkpointing on stock deepspeed, and the
gathers per frozen param are 2 for the params held and 3 for those past the limit. Under the
default limit (1e9) the layer changes nothing: the peak and the gathers equal the layer-off run's.

Mutation: LiveBudget.refused returning nothing (the limit ignored) fails the bound under the
limit; the switch-off run exceeding it shows the test sees the holds.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest

DIM = 8
FROZEN = 4
STEPS = 2
MODULE_NUMEL = DIM * DIM + DIM  # one frozen Linear's weight and bias


class _Block(nn.Module):

    def __init__(self):
        super().__init__()
        self.frozen = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(FROZEN))
        for param in self.frozen.parameters():
            param.requires_grad_(False)
        self.trainable = nn.Linear(DIM, DIM)

    def forward(self, x):
        for linear in self.frozen:
            x = torch.tanh(linear(x))
        return self.trainable(x)


class _Model(nn.Module):

    def __init__(self, checkpointing: bool):
        super().__init__()
        self.checkpointing = checkpointing
        self.block = _Block()

    def forward(self, x, target):
        hidden = (torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
                  if self.checkpointing else self.block(x))
        return F.mse_loss(hidden, target)


def _train(checkpointing: bool, limit=None):
    """(losses, frozen bytes gathered in backward at the peak, all-gathers per frozen param name)."""
    import deepspeed.comm as dist

    from tests.unit.v1.zero.scenario_runner import device, local_rows, random_rows, sgd_engine, train_mean_losses
    from zero3_recompute.testing.probes import GatherCounter, GatheredMemory

    torch.manual_seed(0)
    overrides = {} if limit is None else {"zero_optimization": {"stage3_max_live_parameters": limit}}
    engine = sgd_engine(_Model(checkpointing), lr=0.1, overrides=overrides)
    x, target = (local_rows(tensor).to(device()) for tensor in random_rows(DIM, dist.get_world_size()))
    x.requires_grad_(True)
    memory, counter = GatheredMemory(engine.module), GatherCounter(engine.module)
    try:
        losses = train_mean_losses(engine, x, target, STEPS)
    finally:
        memory.close()
    frozen = {name for name, param in engine.module.named_parameters() if not param.requires_grad}
    gathers = {name: count / STEPS for name, count in counter.take().items() if name in frozen}
    return losses, memory.peak_backward_frozen, gathers


class TestLiveBudget(DistributedTest):
    world_size = 2
    timeout = 240

    @pytest.mark.parametrize("policy", ["auto", "keep"])
    def test_holds_within_the_limit(self, policy):
        import zero3_recompute

        from tests.unit.patch_switch import layers_switched_off, patch_reverted, policy_in_force

        status = zero3_recompute.status()
        if not status.active or "live_budget" not in status.layers:
            pytest.skip(f"the package's live_budget layer is not in force here: {status}")
        limit = MODULE_NUMEL * 3 // 2
        module_bytes = MODULE_NUMEL * 4
        with patch_reverted():
            reference, _, _ = _train(checkpointing=False, limit=limit)
        with policy_in_force(policy):
            losses, peak, gathers = _train(checkpointing=True, limit=limit)
            _, default_peak, default_gathers = _train(checkpointing=True)
        with layers_switched_off("live_budget", policy=policy):
            off_losses, off_peak, off_gathers = _train(checkpointing=True, limit=limit)
            _, off_default_peak, _ = _train(checkpointing=True)
        print(f"\n{policy}: frozen B gathered in backward, limit 1.5 modules ({module_bytes} B a module): "
              f"{peak} (layer off {off_peak}); default limit: {default_peak} (layer off {off_default_peak}); "
              f"gathers per frozen param {sorted(gathers.values())} (layer off {sorted(off_gathers.values())})")
        for name, got in (("with the limit", losses), ("the layer off", off_losses)):
            assert got == pytest.approx(reference, rel=1e-6), f"{policy}, {name}: losses {got}, no checkpoint {reference}"
        assert peak <= 5 * module_bytes // 2, \
            f"{policy}: {peak} B frozen gathered in backward at a limit of 1.5 modules; 2.5 modules = " \
            f"{5 * module_bytes // 2} B (layer off: {off_peak} B)"
        assert off_peak >= FROZEN * module_bytes, f"{policy}, layer off: {off_peak} B, expected every module held"
        held = sorted(gathers.values())
        assert set(held) <= {2, 3} and held.count(2) >= 2, f"{policy}: all-gathers per frozen param {gathers}"
        assert set(off_gathers.values()) == {2}, f"{policy}, layer off: all-gathers per frozen param {off_gathers}"
        assert (default_peak, default_gathers) == (off_default_peak, off_gathers), \
            f"{policy}: under the default limit, peak {default_peak} B and gathers {default_gathers}; layer off " \
            f"{off_default_peak} B and {off_gathers}"
