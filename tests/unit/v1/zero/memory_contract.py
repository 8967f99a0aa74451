"""One measured training run of a memory_models shape, inside every rank.

measure() trains 2 steps (prefetch 0, reuse distance 0, persistence threshold 0, so counts
and bytes are exact) under a release policy of the package, or on stock deepspeed, and
returns what tests/unit/zero_state.GatheredMemory saw during backward, the bytes still
gathered after each backward, the losses, the all-gathers per frozen param per step, and
the frozen params kept gathered past a release that stock makes: after the forward of a
module whose output needs no grad, and after a module's own backward.
"""
import contextlib
from typing import Dict, List, Optional

import torch

from tests.unit.patch_switch import is_recompute_crash, patch_reverted, policy_in_force
from tests.unit.v1.zero.memory_models import BY_NAME, batch, block_frozen_bytes, block_trainable_bytes, build
from tests.unit.v1.zero.scenario_runner import MICRO_BATCH, base_config, device, local_rows, rank_and_world
from tests.unit.zero_state import GatheredMemory, GatherCounter

STOCK = "stock"
STEPS = 2
# A model that no checkpoint runs in takes stock's path whatever the policy (the default policy's
# contract test checks that run against stock's): measured once per rank process, by shape and depth.
_NO_CHECKPOINT_RUNS: Dict[tuple, Dict] = {}


def _switch(policy: str):
    return patch_reverted() if policy == STOCK else policy_in_force(policy)


class _NoGradOutputWatch:
    """Counts frozen params still gathered right after the forward of a module whose output
    needs no grad, inside a backward: stock releases those there, and nothing saved them."""

    def __init__(self, module: torch.nn.Module):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.kept: List[str] = []
        self._available = ZeroParamStatus.AVAILABLE
        self._handles = [sub.register_forward_hook(self._check) for sub in module.modules()]

    def _check(self, module, inputs, output) -> None:
        if torch._C._current_graph_task_id() == -1 or not isinstance(output, torch.Tensor) or output.requires_grad:
            return
        self.kept += [f"{type(module).__name__}.{name}" for name, param in module.named_parameters(recurse=False)
                      if not param.requires_grad and param.ds_status == self._available]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class _OwnBackwardWatch:
    """Names the frozen params still gathered right after their own module's backward release:
    whatever a recompute kept for that backward must go there, as stock's release goes."""

    def __init__(self, engine):
        self.kept: List[str] = []
        self._offload = engine.optimizer.parameter_offload
        self._release = self._offload.post_sub_module_backward_function
        self._offload.post_sub_module_backward_function = self._released

    def _released(self, sub_module):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        result = self._release(sub_module)
        self.kept += [f"{type(sub_module).__name__}.{name}" for name, param in sub_module.named_parameters(recurse=False)
                      if not param.requires_grad and not param.ds_persist
                      and param.ds_status == ZeroParamStatus.AVAILABLE]
        return result

    def close(self) -> None:
        del self._offload.post_sub_module_backward_function


def measure(shape_name: str, depth: int, checkpointing: Optional[str], policy: str) -> Dict:
    """One measured run (the module docstring); a no-checkpoint run under a policy of the package
    is measured once per shape and depth, and shared."""
    if checkpointing is not None or policy == STOCK:
        return _measure(shape_name, depth, checkpointing, policy)
    key = (shape_name, depth)
    if key not in _NO_CHECKPOINT_RUNS:
        _NO_CHECKPOINT_RUNS[key] = _measure(shape_name, depth, None, policy)
    return _NO_CHECKPOINT_RUNS[key]


def _measure(shape_name: str, depth: int, checkpointing: Optional[str], policy: str) -> Dict:
    import deepspeed

    shape = BY_NAME[shape_name]
    _, world_size = rank_and_world()
    where = device()
    result: Dict = {"losses": [], "after_backward": [], "crash": None}
    with _switch(policy), contextlib.ExitStack() as stack:
        model = build(shape, depth, checkpointing)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=base_config(shape.gas))
        memory = GatheredMemory(engine.module)
        stack.callback(memory.close)
        counter = GatherCounter(engine.module)
        stack.callback(counter.close)
        watch = _NoGradOutputWatch(engine.module)
        stack.callback(watch.close)
        own_backward = _OwnBackwardWatch(engine)
        stack.callback(own_backward.close)
        frozen = [name for name, param in engine.module.named_parameters() if not param.requires_grad]
        gathers = []
        try:
            for step in range(STEPS):
                for micro in range(shape.gas):
                    inputs, target, context = batch(shape, step, micro, MICRO_BATCH * world_size)
                    local = [None if t is None else local_rows(t).to(where).detach().requires_grad_(t.requires_grad)
                             for t in (inputs, target, context)]
                    loss = engine(*local)
                    engine.backward(loss)
                    result["losses"].append(loss.item())
                    result["after_backward"].append(memory.after_backward())
                    engine.step()
                counts = counter.take()
                gathers.append(sum(counts[name] for name in frozen) / len(frozen))
        except (RuntimeError, torch.utils.checkpoint.CheckpointError) as exc:
            if not is_recompute_crash(exc):
                raise
            result["crash"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        result.update(peak_backward=memory.peak_backward, peak_backward_frozen=memory.peak_backward_frozen,
                      peak_backward_live=memory.peak_backward_live,
                      peak_backward_live_frozen=memory.peak_backward_live_frozen, block_frozen=block_frozen_bytes(engine.module),
                      block_trainable=block_trainable_bytes(engine.module),
                      gathers_per_frozen_param=gathers, no_grad_outputs_kept=sorted(set(watch.kept)),
                      kept_after_own_backward=sorted(set(own_backward.kept)))
    return result
