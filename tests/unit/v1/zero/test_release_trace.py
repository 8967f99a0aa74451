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
    """Counts PartitionedParameterCoordinator._invalidate_trace calls, for every coordinator, and
    records after each reset_step (the end of a step) whether the trace is complete: a step
    that starts on a complete trace replays it, so an invalidation there is a fetch out of order."""

    def __init__(self):
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        self.count = 0
        self.complete_after_reset = []
        self._cls = PartitionedParameterCoordinator
        self._originals = {name: vars(self._cls)[name] for name in ("_invalidate_trace", "reset_step")}

        def counting(coordinator, *args, **kwargs):
            self.count += 1
            return self._originals["_invalidate_trace"](coordinator, *args, **kwargs)

        def resetting(coordinator, *args, **kwargs):
            result = self._originals["reset_step"](coordinator, *args, **kwargs)
            self.complete_after_reset.append(coordinator.is_complete_trace())
            return result

        self._cls._invalidate_trace = counting
        self._cls.reset_step = resetting

    def close(self) -> None:
        for name, original in self._originals.items():
            setattr(self._cls, name, original)


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
        losses, per_step = [], []
        try:
            for step in range(STEPS):
                before = watch.count
                inputs, target, context = batch(shape, step, 0, MICRO_BATCH * world_size)
                local = [None if t is None else local_rows(t).to(device()).detach().requires_grad_(t.requires_grad)
                         for t in (inputs, target, context)]
                loss = engine(*local)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                per_step.append(watch.count - before)
                assert_all_released(engine.module, f"after step {step} under {policy}")
        finally:
            watch.close()
    return per_step, watch.complete_after_reset, losses


class TestReleaseKeepsTheTrace(DistributedTest):
    world_size = 2
    timeout = 300

    def test_no_policy_invalidates_the_trace_after_the_recording_step(self):
        """deepspeed records the trace in its first steps; once it is complete, every step replays
        it with no invalidation (a step that invalidates it would record again, unprefetched)."""
        losses = {}
        for policy in ("keep", "release"):
            invalidations, complete, losses[policy] = _invalidations(policy)
            replaying = [step for step in range(1, STEPS) if complete[step - 1]]
            assert len(replaying) >= STEPS - 2, f"{policy}: the trace is complete after steps {complete}"
            assert [invalidations[step] for step in replaying] == [0] * len(replaying), \
                f"{policy}: deepspeed's trace invalidated, per step: {invalidations}; complete after: {complete}"
        for ours, theirs in zip(losses["release"], losses["keep"]):
            assert ours == pytest.approx(theirs, rel=1e-5), f"losses: {losses}"
