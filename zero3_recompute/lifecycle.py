"""What happens to a ZeRO-3 parameter while an activation checkpoint recomputes.

NOTE [ Parameter lifecycle under recompute ]

Stock ZeRO-3 moves every non-persistent parameter through one cycle per module call:

    pre-forward  hook: fetch   (all-gather, NOT_AVAILABLE -> AVAILABLE, module id added to
                                param.ds_active_sub_modules)
    post-forward hook: release (module id removed; if the set is then empty the param is
                                partitioned in place: param.data becomes a 0- or 1-element tensor)
    pre-backward hook: fetch   again, for the module's own backward
    post-backward hook: release

A checkpointed block is run twice: once in the forward pass, and once more (the *recompute*)
inside the backward graph task, i.e. while torch._C._current_graph_task_id() != -1. The
recompute fires the same forward hooks, so its post-forward release partitions the params it
has just gathered. torch's non-reentrant checkpoint stores a tensor that does not require grad
as the very object it was given, so for a frozen parameter it stores the Parameter itself.
When the release shrinks that Parameter, the checkpoint's metadata check sees shape [0] and
raises CheckpointError. Trainable parameters are stored as detached aliases that keep the
gathered storage alive, so they survive the release. Under reentrant checkpointing nothing
crashes, but the frozen param is partitioned after the recompute and gathered a third time
by its module's pre-backward fetch.

What this package changes, and only while a release fires inside a backward graph task:

1. Hold. Before the recompute's post-forward release of module M, every frozen param of M
   that stock would consider (non-persistent, not external, AVAILABLE) gets a hold token
   for M added to param.ds_active_sub_modules. Stock's release removes M's id but sees a
   non-empty set and leaves the param gathered, on every deepspeed version we support. The
   fast leaf-module path also sets param.data to a 1-element buffer for released params
   whether or not they were partitioned; for held params we put the gathered tensor back.
2. Release by the owner. M's pre-backward fetch finds the param AVAILABLE (no all-gather).
   Right before M's post-backward release, the hold tokens of M are removed, so that release
   partitions the param exactly as stock would have there.
3. Sweep. Some modules never see their backward release: a block fed an input that needs no
   grad, a module called with keyword arguments only. When the first hold is taken in a
   graph task, a callback is queued on that graph task (queue_callback). It runs when that
   backward ends, whoever started it (engine.backward or loss.backward()), drops every hold
   still taken in that task and releases those params through the coordinator, so its
   bookkeeping of available numel stays right.

So a frozen param is gathered twice per step (forward and recompute) instead of three times,
and it lives from the recompute until its own module's backward, at most until the end of
that backward. Trainable, persistent and external params, and every release outside a
backward graph task (no checkpointing, eval, torch.no_grad forwards), take stock's path
unchanged.
"""
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Set, Tuple

import torch

from zero3_recompute.targets import Targets


class RecomputeHold:
    """A token in param.ds_active_sub_modules that keeps the param gathered. One per module."""

    __slots__ = ("owner", )

    def __init__(self, owner: str):
        self.owner = owner

    def __repr__(self) -> str:
        return f"<zero3_recompute hold by {self.owner}>"


@dataclass
class _Holds:
    token: RecomputeHold
    coordinator: object
    graph_task: int
    params: List[torch.nn.Parameter] = field(default_factory=list)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.data_ptr() == b.data_ptr()


class HoldLedger:
    """The frozen params held since a recompute, by owning module. See NOTE above."""

    def __init__(self, targets: Targets):
        self._targets = targets
        self._lock = threading.Lock()
        self._by_module: Dict[int, _Holds] = {}
        self._armed_tasks: Set[int] = set()

    def held_params(self) -> List[torch.nn.Parameter]:
        with self._lock:
            return [param for holds in self._by_module.values() for param in holds.params]

    def _holdable(self, param) -> bool:
        return (not param.requires_grad and not getattr(param, "ds_persist", False)
                and not getattr(param, "is_external_param", False)
                and param.ds_status == self._targets.available_status)

    def hold(self, offload, module) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        """Step 1 of the NOTE. Returns (param, gathered data) for ``undo_shrink``."""
        targets = self._targets
        leaf = targets.is_leaf_module(module)
        params = [param for param in targets.iter_params(module, recurse=leaf) if self._holdable(param)]
        if not params:
            return []
        graph_task = torch._C._current_graph_task_id()
        with self._lock:
            holds = self._by_module.get(id(module))
            if holds is None:
                holds = _Holds(RecomputeHold(type(module).__name__), None, graph_task)
                self._by_module[id(module)] = holds
            holds.coordinator = targets.coordinator_of(offload, module)
            holds.graph_task = graph_task
            for param in params:
                if holds.token not in param.ds_active_sub_modules:
                    param.ds_active_sub_modules.add(holds.token)
                    holds.params.append(param)
            arm = graph_task not in self._armed_tasks
            self._armed_tasks.add(graph_task)
        if arm:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.sweep(graph_task))
        return [(param, param.data) for param in params]

    @staticmethod
    def undo_shrink(held: List[Tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Step 1 of the NOTE: the fast leaf path swaps param.data even for params it kept."""
        for param, gathered in held:
            if not _same_tensor(param.data, gathered):
                param.data = gathered

    def drop(self, module) -> None:
        """Step 2 of the NOTE: called right before ``module``'s backward release."""
        if not self._by_module:
            return
        with self._lock:
            holds = self._by_module.pop(id(module), None)
        if holds is not None:
            for param in holds.params:
                param.ds_active_sub_modules.discard(holds.token)

    def sweep(self, graph_task: int) -> None:
        """Step 3 of the NOTE: release what is still held when ``graph_task`` ends."""
        with self._lock:
            self._armed_tasks.discard(graph_task)
            ended = [key for key, holds in self._by_module.items() if holds.graph_task == graph_task]
            leftovers = [self._by_module.pop(key) for key in ended]
        self._release_all(leftovers)

    def release_everything(self) -> None:
        """Drop and release every hold, e.g. on revert()."""
        with self._lock:
            leftovers = list(self._by_module.values())
            self._by_module.clear()
        self._release_all(leftovers)

    def _release_all(self, leftovers: List[_Holds]) -> None:
        with torch.no_grad():
            for holds in leftovers:
                for param in holds.params:
                    param.ds_active_sub_modules.discard(holds.token)
                    self._targets.release_param(holds.coordinator, param)
