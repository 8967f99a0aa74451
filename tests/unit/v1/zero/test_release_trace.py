"""deepspeed's module trace under each policy, with its default prefetch and reuse distance.

ZeRO-3 records the order of its fetches in a first step and replays it for prefetching in
the next ones; a step that fetches in another order invalidates the trace, and the step after
it records again, without prefetch. release defers some backward fetches to the recompute: it
must do so the same way in every step, whether or not the params are still gathered then.
"""
import pytest

from tests.unit.common import DistributedTest

STEPS = 6


class _TraceInvalidations:
    """Counts PartitionedParameterCoordinator._invalidate_trace calls, for every coordinator."""

    def __init__(self):
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        self.count = 0
        self._cls = PartitionedParameterCoordinator
        self._original = vars(self._cls)["_invalidate_trace"]

        def counting(coordinator, *args, **kwargs):
            self.count += 1
            return self._original(coordinator, *args, **kwargs)

        self._cls._invalidate_trace = counting

    def close(self) -> None:
        self._cls._invalidate_trace = self._original


def _invalidations(policy: str) -> tuple:
    import deepspeed
    import torch

    from tests.unit.patch_switch import policy_in_force
    from tests.unit.v1.zero.memory_models import BY_NAME, batch, build
    from tests.unit.v1.zero.scenario_runner import MICRO_BATCH, base_config, device, local_rows, rank_and_world
    from tests.unit.zero_state import assert_all_released

    config = base_config()
    for key in ("stage3_prefetch_bucket_size", "stage3_max_reuse_distance"):
        del config["zero_optimization"][key]  # deepspeed's defaults: prefetch and reuse on
    shape = BY_NAME["lora"]
    _, world_size = rank_and_world()
    with policy_in_force(policy):
        model = build(shape, 4, "non_reentrant")
        optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        watch = _TraceInvalidations()
        losses = []
        try:
            for step in range(STEPS):
                inputs, target, context = batch(shape, step, 0, MICRO_BATCH * world_size)
                local = [None if t is None else local_rows(t).to(device()).detach().requires_grad_(t.requires_grad)
                         for t in (inputs, target, context)]
                loss = engine(*local)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                assert_all_released(engine.module, f"after step {step} under {policy}")
        finally:
            watch.close()
    return watch.count, losses


class TestReleaseKeepsTheTrace(DistributedTest):
    world_size = 2
    timeout = 300

    def test_release_invalidates_the_trace_no_more_than_keep(self):
        keep, keep_losses = _invalidations("keep")
        release, release_losses = _invalidations("release")
        assert release <= keep, f"{STEPS} steps: release invalidated deepspeed's trace {release} times, keep {keep}"
        for ours, theirs in zip(release_losses, keep_losses):
            assert ours == pytest.approx(theirs, rel=1e-5), f"losses: release {release_losses}, keep {keep_losses}"
