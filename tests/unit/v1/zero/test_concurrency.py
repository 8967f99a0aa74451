"""Holds belong to their graph task: another engine's forward, on this thread inside a backward
or on another thread while a backward waits, never touches them (RL trainers run a frozen
reference model beside the policy: DPO, GRPO).

The policy model's blocks are frozen LayerNorm -> pause -> trainable Linear, checkpointed
non-reentrant. The pause is an autograd node whose backward runs a callback: it fires after
the block's recompute gathered the norm for its backward, before the norm's backward uses it.
There the reference model (frozen, ZeRO-3, no optimizer) runs a no_grad forward. Checked: the
policy's loss and grads match plain torch, under each policy. Its frozen params are gathered
exactly twice per step under auto and keep (a dropped hold would gather them a third time) and
three times under release (a release that held, the mutation of a policy doing nothing, would
gather them twice). The reference forward leaves nothing gathered, and nothing stays gathered
after any backward or step.
"""
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.scenario_models import PausingBlock

DIM = 16
STEPS = 2


class Policy(nn.Module):

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(PausingBlock() for _ in range(2))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return F.mse_loss(x, target)


class Reference(nn.Module):

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.linear = nn.Linear(DIM, DIM)
        self.requires_grad_(False)

    def forward(self, x):
        return self.linear(self.norm(x))


def _seeded(cls):
    torch.manual_seed(0)
    model = cls()
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad:
                param.uniform_(0.5, 1.5) if param.dim() == 1 else param.normal_(0.0, 0.3)
    return model


class TestHoldsBelongToTheirGraphTask(DistributedTest):
    world_size = 2
    timeout = 180

    @pytest.mark.parametrize("policy", ["auto", "keep", "release"])
    @pytest.mark.parametrize("where", ["same thread", "other thread"])
    def test_reference_forward_during_policy_backward(self, where, policy):
        from tests.unit.patch_switch import policy_in_force

        with policy_in_force(policy):
            self._reference_forward_during_policy_backward(where, policy)

    def _reference_forward_during_policy_backward(self, where, policy):
        import deepspeed

        import zero3_recompute
        from tests.unit.v1.zero.procedures import batches
        from tests.unit.v1.zero.scenario_runner import Run, base_config, device
        from tests.unit.v1.zero.scenarios import BY_NAME
        from tests.unit.zero_state import GatherCounter, assert_all_released, gathered_or_active

        config = base_config()
        run = Run(lambda: _seeded(Policy), config)
        reference, _, _, _ = deepspeed.initialize(model=_seeded(Reference), config=config)
        reference.eval()
        probe = torch.randn(4, DIM, generator=torch.Generator().manual_seed(5)).to(device())
        expected = _seeded(Reference).to(device())(probe)
        seen = []

        def reference_forward():
            with torch.no_grad():
                out = reference(probe)
            torch.testing.assert_close(out, expected)
            kept = gathered_or_active(reference.module)
            assert not kept, f"the reference's forward left {len(kept)} params gathered or active"
            seen.append(where)

        def pause():
            if where == "same thread":
                reference_forward()
                return
            failures = []

            def target():
                try:
                    reference_forward()
                except BaseException as exc:  # reported on the backward's thread
                    failures.append(exc)

            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
            if failures:
                raise failures[0]

        run.module.blocks[1].on_backward = pause
        counter = GatherCounter(run.module)
        frozen = [name for name, param in run.module.named_parameters() if not param.requires_grad]
        try:
            run.train(STEPS, batches(BY_NAME["torch_non_reentrant"]))
            # Gathers come from the training steps only: the reference has params of its own.
            counts = counter.take()
        finally:
            counter.close()
            run.module.blocks[1].on_backward = None
        assert seen == [where] * STEPS, f"the reference forward ran {seen}"
        if zero3_recompute.status().active:
            # Held from the recompute to the norm's backward: 2 per step. Released after the
            # recompute, and gathered again by the norm's backward fetch: 3 (the linear's backward
            # starts the recompute, so the norm's fetch is not deferred).
            per_step = 3 if policy == "release" else 2
            gathered = {name: counts[name] for name in frozen}
            assert gathered == {name: per_step * STEPS for name in frozen}, \
                f"{policy}: all-gathers of frozen params over {STEPS} steps: {gathered}"
        assert_all_released(reference.module, "after training")


class _KeepingCallbacks:
    """Stands in for torch's autograd engine and keeps every callback queued on a graph task:
    what a callback references then outlives the graph task, as when a device thread frees a
    graph task after its exception reached the caller. drop() lets go of them on a worker thread."""

    def __init__(self, engine):
        self._engine = engine
        self._kept = []

    def queue_callback(self, callback):
        self._kept.append(callback)
        return self._engine.queue_callback(callback)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def drop(self) -> None:
        kept, self._kept = self._kept, []
        thread = threading.Thread(target=kept.clear)
        thread.start()
        thread.join()


class TestCleanUpAfterAFailedBackward(DistributedTest):
    """The clean-up of a backward that raised runs on the training thread before the next
    forward resets the coordinator's step (lifecycle NOTE, rule 4), however late and on whatever
    thread torch frees that graph task. Here it is freed on a worker thread after the next step;
    the coordinator's count of available numel must match what is gathered after every step."""
    world_size = 2
    timeout = 180

    def test_graph_task_freed_late_on_another_thread(self):
        import torch

        import zero3_recompute
        from tests.unit.v1.zero.procedures import abort_step_1, assert_counts_consistent, batches, start, step_after_abort
        from tests.unit.v1.zero.scenarios import BY_NAME
        from tests.unit.zero_state import assert_all_released

        if not zero3_recompute.status().active:
            pytest.skip(f"the package is not patched here: {zero3_recompute.status()}")
        scenario = BY_NAME["backward_aborted_halfway"]
        run_ = start(scenario)
        batch = batches(scenario)
        run_.train(1, batch)
        engine = torch.autograd.Variable._execution_engine
        keeping = torch.autograd.Variable._execution_engine = _KeepingCallbacks(engine)
        try:
            abort_step_1(run_, batch, first_recompute=False)
            step_after_abort(run_, batch)
            keeping.drop()
            assert_counts_consistent(run_, "after the aborted backward's graph task was freed on another thread")
            run_.train(1, batch, first_step=3)
            assert_counts_consistent(run_, "after step 3")
            assert_all_released(run_.module, "after step 3")
        finally:
            torch.autograd.Variable._execution_engine = engine
