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
   that stock would consider (not external, AVAILABLE) gets a hold token
   for M added to param.ds_active_sub_modules. Stock's release removes M's id but sees a
   non-empty set and leaves the param gathered, on every deepspeed version we support. The
   fast leaf-module path also sets param.data to a 1-element buffer for released params
   whether or not they were partitioned; for held params we put the gathered tensor back.
   If M's own backward is under way (its backward fetch fired in this graph task, its
   backward release has not: with checkpoint early stop off, M's backward can trigger a
   recompute that runs M's forward to its end), every param of M is held, trainable ones
   too. Both fetches are recorded under M's id, so the recompute's release would otherwise
   cancel the backward's claim and partition params M's backward is about to use.
2. Release by the owner. M's pre-backward fetch finds the param AVAILABLE (no all-gather).
   Right before M's post-backward release, the hold tokens of M are removed, so that release
   partitions the param exactly as stock would have there.
3. Sweep. Some modules never see their backward release: a block fed an input that needs no
   grad, a module called with keyword arguments only (ZeRO attaches the backward release to
   positional inputs). Stock keeps whatever their backward fetch gathered until step(). So
   every module whose backward fetch fires inside a graph task is noted, and un-noted by its
   backward release. With the first note or hold in a graph task, a callback is queued on
   that graph task (queue_callback). It runs when that backward ends, whoever started it
   (engine.backward or loss.backward()): it gives each noted module the backward release
   it missed (stock's own, late), then drops every hold still taken in that task and releases
   those params through the coordinator, so its bookkeeping of available numel stays right.
4. Stale state. A backward that raises never runs its callback. The next forward release
   outside any backward graph task (nothing can be mid-backward on that thread then) first
   does what the missed callbacks would have done, for every graph task still on the books.

So a frozen param is gathered twice per step (forward and recompute) instead of three times,
and it lives from the recompute until its own module's backward, at most until the end of
that backward. Persistent params are held too, since stock partitions them as well while
it records its first step's module trace; the sweep only drops their tokens, as they are
meant to stay resident. Trainable params (but for the in-backward case of step 1), external
params, and every release outside a backward graph task (no checkpointing, eval,
torch.no_grad forwards) take stock's path unchanged.
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
    """The frozen params held since a recompute, by owning module, and the modules whose
    backward release is still due, by graph task. See NOTE above."""

    def __init__(self, targets: Targets):
        self._targets = targets
        self._lock = threading.Lock()
        self._by_module: Dict[int, _Holds] = {}
        # graph task -> {id(module): (offload, module)} fetched for backward, not yet released.
        self._due: Dict[int, Dict[int, Tuple[object, torch.nn.Module]]] = {}
        self._armed_tasks: Set[int] = set()

    def held_params(self) -> List[torch.nn.Parameter]:
        with self._lock:
            return [param for holds in self._by_module.values() for param in holds.params]

    def _holdable(self, param, in_backward: bool) -> bool:
        return ((in_backward or not param.requires_grad)
                and not getattr(param, "is_external_param", False)
                and param.ds_status == self._targets.available_status)

    def _arm(self, graph_task: int) -> None:
        """Queue step 3's sweep on ``graph_task``, once. Call with the lock held."""
        if graph_task in self._armed_tasks:
            return
        self._armed_tasks.add(graph_task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.sweep(graph_task))

    def hold(self, offload, module) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        """Step 1 of the NOTE. Returns (param, gathered data) for ``undo_shrink``."""
        targets = self._targets
        leaf = targets.is_leaf_module(module)
        graph_task = torch._C._current_graph_task_id()
        in_backward = id(module) in self._due.get(graph_task, ())
        params = [param for param in targets.iter_params(module, recurse=leaf) if self._holdable(param, in_backward)]
        if not params:
            return []
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
            self._arm(graph_task)
        return [(param, param.data) for param in params]

    @staticmethod
    def undo_shrink(held: List[Tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        """Step 1 of the NOTE: the fast leaf path swaps param.data even for params it kept."""
        for param, gathered in held:
            if not _same_tensor(param.data, gathered):
                param.data = gathered

    def backward_fetched(self, offload, module) -> None:
        """Step 3 of the NOTE: ``module``'s backward fetch fired; its backward release is due."""
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1:
            return
        with self._lock:
            self._due.setdefault(graph_task, {})[id(module)] = (offload, module)
            self._arm(graph_task)

    def drop(self, module) -> None:
        """Step 2 of the NOTE: called right before ``module``'s backward release."""
        with self._lock:
            holds = self._by_module.pop(id(module), None)
            due = self._due.get(torch._C._current_graph_task_id())
            if due is not None:
                due.pop(id(module), None)
        if holds is not None:
            for param in holds.params:
                param.ds_active_sub_modules.discard(holds.token)

    def sweep(self, graph_task: int) -> None:
        """Step 3 of the NOTE: what ``graph_task`` left behind, released when it ends."""
        with self._lock:
            self._armed_tasks.discard(graph_task)
            due = list(self._due.pop(graph_task, {}).values())
            ended = [key for key, holds in self._by_module.items() if holds.graph_task == graph_task]
        self._release_late(due)
        with self._lock:
            leftovers = [self._by_module.pop(key) for key in ended if key in self._by_module]
        self._release_all(leftovers)

    def has_stale(self) -> bool:
        """Anything on the books, seen from outside every backward: a backward raised (step 4)."""
        return bool(self._by_module or self._due)

    def sweep_stale(self) -> None:
        """Step 4 of the NOTE: do what the callbacks of backwards that raised would have done."""
        with self._lock:
            self._armed_tasks.clear()
            due = [entry for per_task in self._due.values() for entry in per_task.values()]
            self._due.clear()
        self._release_late(due)
        self.release_everything()

    def release_everything(self) -> None:
        """Drop and release every hold, e.g. on revert()."""
        with self._lock:
            leftovers = list(self._by_module.values())
            self._by_module.clear()
        self._release_all(leftovers)

    def _release_late(self, due: List[Tuple[object, torch.nn.Module]]) -> None:
        """Stock's backward release, for modules whose own never fired."""
        backward_release = self._targets.originals["post_sub_module_backward_function"]
        for offload, module in due:
            self.drop(module)
            backward_release(offload, module)

    def _release_all(self, leftovers: List[_Holds]) -> None:
        with torch.no_grad():
            for holds in leftovers:
                for param in holds.params:
                    param.ds_active_sub_modules.discard(holds.token)
                    if not getattr(param, "ds_persist", False):
                        self._targets.release_param(holds.coordinator, param)
