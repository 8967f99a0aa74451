"""The core's holds (lifecycle NOTE, rule 1): tokens in param.ds_active_sub_modules."""
import weakref
from typing import Dict, List, Optional, Set, Tuple

import torch

from zero3_recompute.live_budget import NONE_REFUSED
from zero3_recompute.policies import BY_PARAM, PLACEHOLDER_ALL, Policy, split_by_param
from zero3_recompute.targets import has_children


class Hold:
    """One module's hold, and every graph task that took it: a nested one (a reentrant checkpoint's
    inner backward) adds itself, and its end releases nothing an enclosing task still holds. The
    hold itself is the token in each of its params' ds_active_sub_modules that keeps it gathered
    (hashed by identity)."""

    __slots__ = ("owner", "coordinator", "module", "graph_tasks", "params")

    def __init__(self, module, coordinator, graph_task: int):
        self.owner: str = type(module).__name__  # the class name of the module
        self.coordinator = coordinator
        self.module: "weakref.ref[torch.nn.Module]" = weakref.ref(module)
        self.graph_tasks: Set[int] = {graph_task}
        self.params: List[torch.nn.Parameter] = []

    def __repr__(self) -> str:
        return f"<zero3_recompute hold by {self.owner}>"


class HoldRegistry:
    """The holds by module id, and each graph task's, so that its sweep visits its own alone. The
    ledger's lock is held around every method but ``taken_in``, one dict read, and ``drop``, which takes it."""

    def __init__(self):
        # Read without the lock by the ledger's test for whether anything is held at all.
        self.by_module: Dict[int, Hold] = {}
        self._by_task: Dict[int, Set[int]] = {}

    def params(self) -> List[torch.nn.Parameter]:
        return [param for hold in self.by_module.values() for param in hold.params]

    def hold(self, module, coordinator, params: List[torch.nn.Parameter], graph_task: int) -> None:
        key = id(module)
        hold = self.by_module.get(key)
        if hold is None:
            hold = self.by_module[key] = Hold(module, coordinator, graph_task)
        else:
            hold.coordinator = coordinator
            hold.graph_tasks.add(graph_task)
        keys = self._by_task.get(graph_task)
        if keys is None:
            self._by_task[graph_task] = {key}
        else:
            keys.add(key)
        held = hold.params
        for param in params:
            active = param.ds_active_sub_modules
            if hold not in active:
                active.add(hold)
                held.append(param)

    def taken_in(self, graph_task: int) -> bool:
        """Whether ``graph_task`` holds anything; a dict read, also without the lock."""
        return graph_task in self._by_task

    def of_task(self, graph_task: int) -> List[Tuple[int, Hold]]:
        """The holds ``graph_task`` took, by module id; a list, so that the caller may take them."""
        keys = self._by_task.get(graph_task)
        return [(key, self.by_module[key]) for key in keys] if keys else []

    def take(self, key: int) -> Optional[Hold]:
        """Off the books (None if not held); its tokens stay until dropped or released."""
        hold = self.by_module.pop(key, None)
        if hold is None:
            return None
        for graph_task in hold.graph_tasks:
            keys = self._by_task.get(graph_task)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_task[graph_task]
        return hold

    def drop(self, key: int, lock) -> None:
        """Rule 2: the hold of the module with id ``key`` off the books (under ``lock``, the ledger's), and its
        tokens gone, so that its params partition at the release that follows exactly as stock's would."""
        with lock:
            hold = self.take(key)
        if hold is not None:
            for param in hold.params:
                param.ds_active_sub_modules.discard(hold)

    def take_ended(self, graph_task: int) -> List[Hold]:
        """The end of ``graph_task``: the holds no other graph task still holds."""
        ended = []
        for key in self._by_task.pop(graph_task, ()):
            hold = self.by_module[key]
            hold.graph_tasks.discard(graph_task)
            if not hold.graph_tasks:
                ended.append(self.take(key))
        return ended

    def take_all(self) -> List[Hold]:
        ended, self.by_module, self._by_task = list(self.by_module.values()), {}, {}
        return ended


class HoldTaking:
    """Rule 1's mechanics under one policy, decided when the ledger takes the policy up (Policy.mechanics):
    what a recompute release's frozen params get under a saved-tensors hook and without one, and
    the hold put on the books. The ledger's lock is taken around its books and holds alone."""

    def __init__(self, targets, policy: Policy, placeholders_on: bool, budget, books, holds: HoldRegistry, lock):
        self._coordinator_of, self._is_leaf_module = targets.coordinator_of, targets.is_leaf_module
        self._iter_params, self._available = targets.iter_params, targets.available_status
        self._budget, self._books, self._holds, self._lock = budget, books, holds, lock
        # Under a saved-tensors hook, and without one: None where the release is stock's.
        self.under_hooks = policy.mechanics(True, placeholders_on)
        self.without_hooks = policy.mechanics(False, placeholders_on)

    def take(self, offload, module, graph_task: int, mechanics: str, frozen_only: bool = True):
        """(held, each held param with the data a leaf's release may swap, placeholder candidates) of
        ``module``'s params gathered and not external (the frozen alone where ``frozen_only``; rule 6
        takes every one): as ``mechanics`` has them, the held on the books. One frame from the params
        to the books: it runs at every recompute release the ledger does not leave to stock's."""
        # A module with children is read as deepspeed's leaf or not here, once; one without, only if it holds.
        children = has_children(module)
        recurse = self._is_leaf_module(module) if children else False
        available, params = self._available, []
        for param in self._iter_params(module, recurse=recurse):  # a loop, not a comprehension's frame
            if not (frozen_only and param.requires_grad) and param.ds_status == available \
                    and not getattr(param, "is_external_param", False):
                params.append(param)
        if not params:
            return params, [], []
        if mechanics == PLACEHOLDER_ALL:
            return [], [], params
        coordinator, placeholder = self._coordinator_of(offload, module), []
        if mechanics == BY_PARAM:
            refused = self._budget.refused(coordinator, params) if self._budget is not None else NONE_REFUSED
            params, placeholder = split_by_param(params, refused)
            if not params:
                return params, [], placeholder
        with self._lock:
            task = self._books.tasks.get(graph_task)  # its coordinator noted already (a hold, a fetch): no frame
            if task is None or id(coordinator) not in task.coordinators:
                self._books.touch(graph_task, coordinator)
            self._holds.hold(module, coordinator, params, graph_task)
        # deepspeed's fast leaf path swaps param.data even for params it keeps (restore_gathered).
        leaf = recurse if children else self._is_leaf_module(module)
        return params, [(param, param.data) for param in params] if leaf else [], placeholder


def restore_gathered(held: List[Tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """After stock's release kept a held param: deepspeed's fast leaf path swaps param.data for a
    1-element buffer even for params it kept; the gathered tensor goes back (only then: ZenFlow
    transposes param.data in place of a release, same numel, not ours to undo)."""
    for param, gathered in held:
        if param.numel() < gathered.numel():  # read off the param: param.data makes a tensor per read
            param.data = gathered


class CallsDue:
    """Rule 5: per module, its calls whose backward release is still to come. Counted for every
    engine from its first forward (an engine is known to checkpoint only once that forward ends);
    a count too high only holds as before the rule.

    In the module's own __dict__, under this ledger's key (NOTE [ Notes on the module ]); no lock,
    as every hook of every engine changes a count. Threads: a module's forward releases (the
    training thread) and its backward release and recomputes (the thread autograd runs its backward
    on) never change its count at once, since a module's backward follows its forward; counts of
    different modules may change at once on two threads, and each dict operation is atomic.

    The hottest paths do these dict operations in place, without a frame: the wrappers' forward
    releases outside any backward (both of their adds) and backward releases (patch._build_wrappers:
    an engine no checkpoint ran in, and an open task without placeholders), HoldLedger.before_backward_release,
    and the recompute release's add and test."""

    __slots__ = ("key", )

    def __init__(self, key: str):
        self.key = key  # NoteKeys.calls_due

    def add(self, module) -> None:
        notes, key = module.__dict__, self.key
        notes[key] = notes.get(key, 0) + 1

    def take(self, module) -> None:
        """One backward release of ``module``, stock's or late (a count never goes below 0)."""
        notes, key = module.__dict__, self.key
        count = notes.get(key)
        if count:
            notes[key] = count - 1

    def __contains__(self, module) -> bool:
        return module.__dict__.get(self.key, 0) > 0
