"""The core's own releases (lifecycle NOTE, rules 2 to 4): whom they reach, and how they release."""
from typing import Callable, Dict, List, Optional, Tuple

import torch

from zero3_recompute.by_id import ById
from zero3_recompute.targets import Targets


class Leftovers:
    """Rule 2's descendants: modules below a module whose backward release is about to run, that
    will never get one of their own. ZeRO counts a module's positional inputs that need grad
    (ds_grads_remaining) and releases when the last one's grad arrives: calls by keyword and
    inputs that need no grad count none. Stock keeps what their backward fetch gathered until
    step(); here a block's leftovers go with its backward, so nothing held grows with depth."""

    def __init__(self):
        # id(model) -> {id(child): id(parent)}. Ids only: a reference to a module here would keep
        # its model alive for good.
        self._parents = ById()

    @staticmethod
    def nothing_below(offload, module, task, holds, graph_task: int) -> bool:
        """Whether ``below`` would find nothing, read without the lock or any ancestry: ``graph_task``
        holds nothing, and each module ``task`` has due but ``module`` and the engine's root has a
        release coming (its ancestors, in a backward whose modules each get their own)."""
        if holds.taken_in(graph_task):
            return False
        if task is not None and task.due:
            root = offload.module
            for _, other in tuple(task.due.values()):  # a copy (atomic): fetches write it unlocked
                if other is not module and other is not root and _no_release_coming(other):
                    return False
        return True

    def below(self, offload, module, task, holds, graph_task: int) -> Tuple[List[Tuple[object, torch.nn.Module]], list]:
        """(modules of ``task`` due below ``module``, holds below it that ``graph_task`` took, taken
        off ``holds``, a HoldRegistry), each with no backward release coming. Call with the
        ledger's lock held. What has a release coming is passed over before any ancestry is read:
        in a backward whose modules each get their own release, that test is all it costs."""
        task_due = dict(task.due) if task is not None else {}  # a copy (atomic): fetches write it unlocked
        # The engine's root is ``module`` or its ancestor, never below it.
        root, own = offload.module, id(module)
        due = [(key, entry) for key, entry in task_due.items()
               if key != own and entry[1] is not root and _no_release_coming(entry[1])]
        held = [(key, hold) for key, hold in holds.of_task(graph_task)
                if key not in task_due and _no_release_coming(hold.module())]
        if not due and not held:
            return [], []
        parents = self._parent_map(offload, [key for key, (owner, _) in task_due.items() if owner is offload])
        orphans = [holds.take(key) for key, _ in held if _descends(key, module, parents)]
        return [entry for key, entry in due if _descends(key, module, parents)], orphans

    def _parent_map(self, offload, keys) -> Dict[int, int]:
        """Built again when one of ``keys`` (modules fetched for backward) is not in it: a module
        added after the map was built."""
        root = offload.module
        parents = self._parents.get(id(root))
        if parents is None or any(key not in parents and key != id(root) for key in keys):
            parents = self._parents.put(root, {id(child): id(parent) for parent in root.modules()
                                               for child in parent.children()})
        return parents


def _no_release_coming(module: Optional[torch.nn.Module]) -> bool:
    """False for a module collected (a hold's weak reference gone): nothing left to release."""
    return module is not None and getattr(module, "ds_grads_remaining", 0) <= 0


def _descends(key: int, ancestor: torch.nn.Module, parents: Dict[int, int]) -> bool:
    """Whether the module with id ``key`` sits below ``ancestor``; unknown ids do not."""
    parent = parents.get(key)
    while parent is not None:
        if parent == id(ancestor):
            return True
        parent = parents.get(parent)
    return False


class ReleaseLate:
    """How the core releases: stock's backward release late, a dropped hold's params through the
    coordinator (so its count of available numel stays right), and a raised backward's prefetch.
    Each frees what kept storage took in under the params it partitions."""

    def __init__(self, targets: Targets, kept_storage, drop: Callable[[torch.nn.Module], None]):
        self._targets = targets
        self._kept = kept_storage
        self._drop = drop

    def release(self, due: List[Tuple[object, torch.nn.Module]]) -> None:
        """Stock's backward release, for modules whose own never fired."""
        if not due:
            return
        backward_release = (self._targets.late_backward_release
                            or self._targets.originals["post_sub_module_backward_function"])
        kept = self._kept
        for offload, module in due:
            release = kept.before_release(offload, module) if kept.engaged else None
            self._drop(module)
            backward_release(offload, module)
            if release is not None:
                kept.after_release(release)

    def release_holds(self, ended: list) -> None:
        if not ended:
            return
        released = []
        with torch.no_grad():
            for hold in ended:
                for param in hold.params:
                    param.ds_active_sub_modules.discard(hold)
                    if not getattr(param, "ds_persist", False):  # persistent params stay resident
                        self._targets.release_param(hold.coordinator, param)
                        released.append(param)
        self._kept.after_params_released(released)

    def release_prefetched(self, engines: list, coordinator) -> None:
        """Rule 4: what a raised backward's prefetch gathered for the modules of ``engines`` it never
        reached, released through ``coordinator`` (theirs) before its reset_step zeroes its count of
        available numel (a release after it would drive that count negative)."""
        available = self._targets.available_status
        with torch.no_grad():
            for offload in engines:
                if self._targets.coordinator_of(offload, offload.module) is not coordinator:
                    continue
                for param in self._targets.iter_params(offload.module, recurse=True):
                    if (param.ds_status == available and not param.ds_active_sub_modules and not getattr(
                            param, "ds_persist", False) and not getattr(param, "is_external_param", False)):
                        self._targets.release_param(coordinator, param)
