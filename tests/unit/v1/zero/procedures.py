"""Training procedures for the scenario matrix; each runs inside every rank.

run(scenario) builds the ZeRO-3 engine and its reference, trains, and raises on the first
disagreement: Mismatch (loss or grads), LeakError (partition state), or whatever deepspeed
raised. observe_stock(scenario) runs the same with the patch reverted and names the outcome.
"""
import contextlib
from typing import Callable, Dict, List

import pytest
import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointError

from tests.unit.patch_switch import is_recompute_crash, patch_reverted
from tests.unit.v1.zero import scenario_models as models
from tests.unit.v1.zero.scenario_runner import Mismatch, Run, base_config, gathered_count, make_batch, merge
from tests.unit.v1.zero.scenarios import CRASH, LEAK, OK, Scenario
from tests.unit.zero_state import LeakError, assert_all_released

STEPS = 3
WRONG = "wrong"


def _build(scenario: Scenario) -> Callable[[], torch.nn.Module]:

    def build():
        model = scenario.build()
        if scenario.leaf_classes:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, list(scenario.leaf_classes))
        return model

    return build


def _after_initialize(scenario: Scenario):

    def prepare(module: torch.nn.Module) -> None:
        if scenario.register_external:
            for sub_module in module.modules():
                if isinstance(sub_module, models.Gated):
                    sub_module.register()

    return prepare


def batches(scenario: Scenario):

    def batch(step: int, micro: int):
        return make_batch(step, micro, scenario.tokens, scenario.input_grad, models.DIM, models.VOCAB)

    return batch


def start(scenario: Scenario) -> Run:
    config = merge(base_config(scenario.gas), dict(scenario.config, zero_optimization=scenario.zero))
    return Run(_build(scenario), config, scenario.dtype, scenario.zero_init, _after_initialize(scenario))


def run(scenario: Scenario) -> None:
    reason = scenario.unavailable()
    if reason is not None:
        pytest.skip(reason)
    # Only where a scenario turns early stop off globally: the context manager overrides a
    # checkpoint's own early_stop argument (torch 2.13 on), which another scenario passes.
    early_stop = contextlib.nullcontext() if scenario.early_stop else torch.utils.checkpoint.set_checkpoint_early_stop(False)
    with early_stop, \
            fp16_allowed(scenario.dtype == torch.float16), stream_stand_in(scenario.needs_stream):
        PROCEDURES[scenario.procedure](scenario, start(scenario))


@contextlib.contextmanager
def fp16_allowed(needed: bool):
    """deepspeed's CPU accelerator reports fp16 only where mkldnn has it, and refuses an fp16
    config otherwise; torch's own CPU half kernels run this model, so vouch for them."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not needed or accelerator.is_fp16_supported():
        yield
        return
    accelerator.is_fp16_supported = lambda: True
    try:
        yield
    finally:
        del accelerator.is_fp16_supported


class _NoStream:
    """A stream that orders nothing: on a CPU accelerator every op already runs in program order."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = device

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


@contextlib.contextmanager
def stream_stand_in(needed: bool):
    """deepspeed.checkpointing.checkpoint and non_reentrant_checkpoint construct
    get_accelerator().Stream(device=...) on every call in 0.16 to 0.19.7, but deepspeed's CPU
    accelerator has no stream class (its Stream is None, its stream() a no-op context). Lend
    its class one that orders nothing, for this scenario only; the exact original goes back."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not needed or accelerator.device_name() != "cpu" or accelerator.Stream is not None:
        yield
        return
    cls = type(accelerator)
    original = vars(cls)["Stream"]
    cls.Stream = property(lambda self: _NoStream)
    try:
        yield
    finally:
        cls.Stream = original


def observe_stock(scenario: Scenario) -> str:
    """What stock deepspeed does with this scenario: OK, CRASH, LEAK or WRONG."""
    with patch_reverted():
        try:
            run(scenario)
        except LeakError:
            return LEAK
        except Mismatch:
            return WRONG
        except (CheckpointError, RuntimeError) as error:
            if not is_recompute_crash(error):
                raise  # another failure: not the crash the scenario table records
            return CRASH
    return OK


def _train(scenario: Scenario, run_: Run) -> None:
    run_.train(STEPS, batches(scenario))


def _accumulation(scenario: Scenario, run_: Run) -> None:
    """Gathered params, sampled at every module's forward and backward, do not grow from one
    micro-batch to the next; after each backward none is left."""
    peaks: List[int] = []
    sampler = _PeakSampler(run_.module)
    try:
        batch = batches(scenario)
        for step in range(STEPS):
            for micro in range(run_.gas):
                sampler.peak = 0
                inputs, target = batch(step, micro)
                run_.forward_backward(inputs, target, f"step {step} micro-batch {micro}")
                peaks.append(sampler.peak)
                if micro < run_.gas - 1:
                    run_.engine.step()
            run_.check_grads(f"step {step}")
            run_.step(f"step {step}")
    finally:
        sampler.close()
    # With prefetch on, deepspeed prefetches only once it has recorded its module trace (the
    # first micro-batch): compare from the second on.
    settled = peaks[1:] if scenario.zero.get("stage3_prefetch_bucket_size", 0) else peaks
    if len(set(settled)) != 1 or settled[0] == 0:
        raise LeakError(f"peak gathered params per micro-batch: {peaks}; expected one non-zero value"
                        f"{' from the second on (prefetch)' if settled is not peaks else ''}")


class _PeakSampler:
    """The most non-persistent params gathered at once, sampled at module hooks."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.peak = 0
        self.handles = []
        for sub_module in module.modules():
            self.handles.append(sub_module.register_forward_hook(self._sample))
            self.handles.append(sub_module.register_full_backward_hook(self._sample))

    def _sample(self, *unused) -> None:
        self.peak = max(self.peak, gathered_count(self.module))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _persistent(scenario: Scenario, run_: Run) -> None:
    """Persistent frozen params stay gathered; the rest is released as usual.

    Stock deepspeed releases persistent params too while it records its first step's module
    trace, and gathers them back in step(); from then on they stay resident.
    """
    frozen_persistent = [p for p in run_.module.parameters() if p.ds_persist and not p.requires_grad]
    partitioned = [p for p in run_.module.parameters() if not p.ds_persist and not p.requires_grad]
    if not frozen_persistent or not partitioned:
        raise AssertionError(f"expected persistent and partitioned frozen params, got {len(frozen_persistent)} "
                             f"and {len(partitioned)}")
    batch = batches(scenario)
    for step in range(STEPS):
        inputs, target = batch(step, 0)
        run_.forward_backward(inputs, target, f"step {step}")
        if step > 0:
            _assert_resident(frozen_persistent, f"after backward of step {step}")
        run_.check_grads(f"step {step}")
        run_.step(f"step {step}")
        _assert_resident(frozen_persistent, f"after step {step}")


def _assert_resident(params, when: str) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    gone = [(p.ds_id, p.ds_status.name, p.numel(), p.ds_numel) for p in params
            if p.ds_status != ZeroParamStatus.AVAILABLE or p.numel() != p.ds_numel]
    if gone:
        raise LeakError(f"persistent params {gone} were partitioned {when}")


def _fast_leaf(scenario: Scenario, run_: Run) -> None:
    from deepspeed.utils import z3_leaf_module

    leaves = [type(m).__name__ for m in run_.module.modules() if z3_leaf_module(m)]
    if leaves != ["FrozenNormLinear"] * 4:
        raise AssertionError(f"expected the four blocks as ZeRO-3 leaf modules, got {leaves}")
    _train(scenario, run_)


def _fp16_overflow(scenario: Scenario, run_: Run) -> None:
    """Step 1's input is inf: its grads overflow, deepspeed skips the step and halves the scale."""
    batch = batches(scenario)
    run_.train(1, batch)
    inputs, target = batch(1, 0)
    scale = run_.engine.optimizer.loss_scale
    skipped = run_.engine.skipped_steps
    with torch.no_grad():
        inputs = inputs.clone().fill_(float("inf")).requires_grad_(inputs.requires_grad)
    run_.forward_backward(inputs, target, "overflowing step 1", skip_reference=True)
    run_.step("overflowing step 1", reference_too=False)
    if run_.engine.skipped_steps != skipped + 1 or not run_.engine.optimizer.loss_scale < scale:
        raise AssertionError(f"expected a skipped step and a lower loss scale; skipped {skipped} -> "
                             f"{run_.engine.skipped_steps}, scale {scale} -> {run_.engine.optimizer.loss_scale}")
    run_.train(STEPS - 1, batch, first_step=2)


def _interleave(scenario: Scenario, run_: Run) -> None:
    """Between training steps: an eval forward, then a no-grad generation loop over the blocks."""
    batch = batches(scenario)
    for step in range(STEPS):
        run_.train(1, batch, first_step=step)
        inputs, target = batch(100 + step, 0)
        local = inputs[:4].detach().to(run_.device, run_.dtype)
        run_.engine.eval()
        with torch.no_grad():
            run_.engine(local, target[:4].to(run_.device, run_.dtype))
            assert_all_released(run_.module, f"after the eval forward after step {step}")
            hidden = local
            for _ in range(3):
                for block in run_.module.blocks:
                    hidden = torch.tanh(block(hidden))
                assert_all_released(run_.module, f"after a generation step after step {step}")
        run_.engine.train()


def _fault(first_recompute: bool):
    """Step 1's backward raises inside a recompute; the batch is dropped, training goes on.

    first_recompute: the last block raises, in the first recompute of that backward. Otherwise
    the first block raises, after the (frozen) last block's recompute and backward ran: a
    backward aborted halfway. Either way no gradient has reached ZeRO-3's reduction buckets
    yet; stock deepspeed cannot go on after one has (a duplicate param in its bucket), which
    is not this package's to change. The recovery is what a training loop does with a bad
    batch: zero the gradients and carry on.
    """

    def procedure(scenario: Scenario, run_: Run) -> None:
        batch = batches(scenario)
        run_.train(1, batch)
        abort_step_1(run_, batch, first_recompute)
        assert_counts_consistent(run_, "right after the aborted backward")
        step_after_abort(run_, batch)
        run_.train(STEPS - 2, batch, first_step=3)

    return procedure


def _fault_then_eval(scenario: Scenario, run_: Run) -> None:
    """Step 1's backward raises inside its first recompute and the loop goes on, as an OOM-skip
    loop or a notebook does: an eval forward and a no-grad generation loop come first (the
    aborted backward's clean-up runs before them, with every module in eval mode), then
    training resumes. Nothing may raise, and nothing may stay gathered after the eval."""
    batch = batches(scenario)
    run_.train(1, batch)
    abort_step_1(run_, batch, first_recompute=True)
    inputs, _ = batch(100, 0)
    local = inputs[:4].detach().to(run_.device, run_.dtype)
    run_.engine.eval()
    with torch.no_grad():
        run_.engine(local, batch(100, 0)[1][:4].to(run_.device, run_.dtype))
        assert_all_released(run_.module, "after the eval forward after the aborted backward")
        hidden = local
        for block in run_.module.blocks:
            hidden = torch.tanh(block(hidden))
        assert_all_released(run_.module, "after a generation step after the aborted backward")
    run_.engine.train()
    assert_counts_consistent(run_, "after the eval that followed the aborted backward")
    step_after_abort(run_, batch)
    run_.train(STEPS - 2, batch, first_step=3)


def abort_step_1(run_: Run, batch, first_recompute: bool) -> None:
    """Step 1's backward raises inside a recompute: of the last block (first_recompute), else
    of the first (halfway through the backward)."""
    blocks = list(run_.module.blocks)
    (blocks[-1] if first_recompute else blocks[0]).armed = True
    inputs, target = batch(1, 0)
    with pytest.raises(models.InjectedFault):
        run_.forward_backward(inputs, target, "aborted step 1", skip_reference=True)


def step_after_abort(run_: Run, batch) -> None:
    """The aborted batch dropped as a training loop drops it (gradients zeroed), then step 2,
    its counts checked after its backward."""
    from zero3_recompute.patch import graph_tasks_on_the_books

    run_.engine.zero_grad()
    run_.reference_optimizer.zero_grad()
    inputs, target = batch(2, 0)
    # The aborted backward's clean-up runs before the next forward fetches anything but its root:
    # run later, its late releases would take back what that forward has just gathered.
    left_open = []
    first_block = next(iter(run_.module.blocks))
    handle = first_block.register_forward_pre_hook(
        lambda module, args: left_open.append(graph_tasks_on_the_books()))
    try:
        run_.forward_backward(inputs, target, "step 2")
    finally:
        handle.remove()
    if left_open[:1] != [0]:
        raise LeakError(f"graph tasks still on the books when step 2's first block started: {left_open[:1]}")
    # The next forward reset the coordinator's count: whatever the aborted backward left
    # must have been released before that.
    assert_counts_consistent(run_, "after the backward that followed the aborted one")
    run_.check_grads("step 2")
    run_.step("step 2")


def assert_counts_consistent(run_: Run, when: str) -> None:
    """The coordinator's count of available numel (its prefetch budget) matches what is
    gathered: a release after the next forward reset that count would drive it negative."""
    from tests.unit.zero_state import coordinator_counts

    counted, gathered = coordinator_counts(run_.engine)
    if counted != gathered:
        raise LeakError(f"{when}: the coordinator counts {counted} available numel, {gathered} are gathered")


PROCEDURES: Dict[str, Callable[[Scenario, Run], None]] = {
    "train": _train,
    "accumulation": _accumulation,
    "persistent": _persistent,
    "fast_leaf": _fast_leaf,
    "fp16_overflow": _fp16_overflow,
    "interleave": _interleave,
    "fault_first_recompute": _fault(first_recompute=True),
    "fault_halfway": _fault(first_recompute=False),
    "fault_then_eval": _fault_then_eval,
}
