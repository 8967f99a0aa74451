"""The books of each backward graph task the package takes part in.

NOTE [ Graph task books ]

1. A graph task's books open with its first backward fetch of an engine a checkpoint ran in, or
   with its first hold or placeholder, and hold what that task alone put on them.
2. Opening them queues a callback on that graph task, which sweeps it when its backward ends,
   whoever started it (engine.backward or loss.backward()).
3. A backward that raises never runs its callback: torch drops the callback with the graph task,
   and a finalizer on the one object the callback held then queues the task's id, on whatever
   thread frees it.
4. The queued ids, and every task still open for a coordinator whose next forward starts, are
   swept on the training thread, outside any backward; a task is swept once.
"""
import collections
import weakref
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch


class GraphTask:
    """What one backward graph task put on the books: the modules whose backward release is due,
    the placeholders left (zero3_recompute.placeholders), the coordinators it touched (by id), the
    engines known to use them, and the finalizer of rule 3."""

    __slots__ = ("due", "placeholders", "coordinators", "engines_noted", "finalizer")

    def __init__(self):
        # id(module) -> (offload, module), fetched for backward, not yet released.
        self.due: Dict[int, Tuple[object, torch.nn.Module]] = {}
        self.placeholders: list = []
        self.coordinators: Set[int] = set()
        # The ids of engines whose one coordinator is in coordinators (targets.coordinator_per_engine).
        self.engines_noted: Set[int] = set()
        self.finalizer: Optional[weakref.finalize] = None

    def engines(self) -> List[object]:
        """The engines (DeepSpeedZeRoOffload) of the modules still due, each once."""
        return list({id(offload): offload for offload, _ in list(self.due.values())}.values())


class _CallbackHeld:
    """Held only by the callback queued on a graph task (rule 3)."""

    __slots__ = ("__weakref__", )


class GraphTaskBooks:
    """The open books, by graph task id, and the ids of tasks freed without their callback. The
    caller holds its own lock around every method but ``ended``'s queue, which a finalizer appends
    to on any thread, and ``note_fetch``, which takes it where it must."""

    def __init__(self, sweep: Callable[[int], None], touched: Callable[[object], None],
                 coordinator_of: Callable[[object, object], object], per_engine: bool):
        self._sweep = sweep
        self._touched = touched
        # (engine, submodule) -> the coordinator its hooks use, and whether it reads the engine alone
        # (targets.Targets.coordinator_of, .coordinator_per_engine).
        self._coordinator_of, self._per_engine = coordinator_of, per_engine
        # By graph task id; the ledger reads it (get) without a call at every backward hook.
        self.tasks: Dict[int, GraphTask] = {}
        # The ids of tasks freed without their callback (rule 3); true while any is queued.
        self.queued: "collections.deque[int]" = collections.deque()

    def __len__(self) -> int:
        return len(self.tasks)

    def any_left(self) -> bool:
        """Whether a task is open or queued by its finalizer."""
        return bool(self.tasks or self.queued)

    def open(self, graph_task: int) -> GraphTask:
        """The books of ``graph_task``, opened once (rules 1 and 2)."""
        task = self.tasks.get(graph_task)
        if task is not None:
            return task
        task = self.tasks[graph_task] = GraphTask()
        held = _CallbackHeld()
        task.finalizer = weakref.finalize(held, self.queued.append, graph_task)
        task.finalizer.atexit = False
        torch.autograd.Variable._execution_engine.queue_callback(lambda: (held, self._sweep(graph_task)))
        return task

    def touch(self, graph_task: int, coordinator) -> GraphTask:
        """The books of ``graph_task`` (opened), with ``coordinator`` noted in them; ``touched(coordinator)``
        follows its first note."""
        task = self.tasks.get(graph_task) or self.open(graph_task)  # opened by the task's first fetch or hold
        if id(coordinator) not in task.coordinators:
            task.coordinators.add(id(coordinator))
            self._touched(coordinator)
        return task

    def note_fetch(self, graph_task: int, task: Optional[GraphTask], offload, module, lock) -> GraphTask:
        """The books of ``graph_task`` (``task``, where open) with the coordinator of ``module``'s
        backward fetch noted, under ``lock`` where it is new; where an engine has one coordinator,
        the engine too, so that its later fetches in this task read none."""
        coordinator = self._coordinator_of(offload, module)
        if task is None or id(coordinator) not in task.coordinators:
            with lock:
                task = self.touch(graph_task, coordinator)
        if self._per_engine:
            task.engines_noted.add(id(offload))
        return task

    def close(self, graph_task: Optional[int]) -> List[GraphTask]:
        """Take ``graph_task``'s books off (every task's, for None); empty if swept already."""
        if graph_task is None:
            closed, self.tasks = list(self.tasks.values()), {}
        else:
            closed = [task for task in (self.tasks.pop(graph_task, None), ) if task is not None]
        for task in closed:
            task.finalizer.detach()
        return closed

    def ended(self, coordinator=None) -> Tuple[List[int], List[object]]:
        """Rule 4: the ids of the tasks to sweep now (those queued by their finalizers, and those
        open for ``coordinator``), and the engines still due in the latter."""
        ids, engines = [], {}
        while self.queued:
            ids.append(self.queued.popleft())
        if coordinator is not None:
            for key, task in self.tasks.items():
                if id(coordinator) in task.coordinators:
                    ids.append(key)
                    engines.update((id(offload), offload) for offload in task.engines())
        return ids, list(engines.values())
