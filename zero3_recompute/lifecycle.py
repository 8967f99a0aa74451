"""The core: what happens to a ZeRO-3 parameter while an activation checkpoint recomputes.

Why a recompute's release breaks the checkpoint is in docs/how-it-works.md.

NOTE [ Parameter lifecycle under recompute ]

Inside a backward graph task (torch._C._current_graph_task_id() != -1):
1. Hold: a recompute's release of module M leaves M's frozen params gathered, by a token in
   param.ds_active_sub_modules, when the policy says so, M's output needs grad and M has a call
   whose backward release is still to come (rule 5); otherwise the release is stock's.
2. Drop: right before M's own backward release, descendants of M that will never get one get it
   late, then M's tokens go, so that M's release partitions exactly as stock's would there.
3. Sweep: when the graph task ends, each module still due gets its backward release late, each
   hold the task took is dropped and released through the coordinator, and each placeholder goes.
4. Fault: a graph task that raised is swept before its coordinator's next forward gathers
   anything, and what its prefetch gathered for modules it never reached is released.
5. Count: each call that builds a graph (a grad-enabled forward, a reentrant recompute) makes
   one backward release due to its module, and each backward release, stock's or late, takes one.
6. While M's own backward is under way (fetched for backward in this task, not yet released),
   a recompute's release of M holds every param of M, trainable ones too.
7. Every other release, and each release of an engine no checkpoint ran in, is stock's: there a
   forward release outside any checkpoint (grad on, no saved-tensors hook) and every backward hook
   pass straight to deepspeed after one test, rule 5's count kept.
The layers over this core: zero3_recompute.placeholders, .deferral, .kept_storage, .hook_stack.

NOTE [ Which thread touches what ]

1. The training thread runs the forward hooks (rule 5's count, the engine facts, the forward
   watch), rule 4 and reset_step; autograd's threads (the caller's on a CPU, one per device on an
   accelerator) run the backward hooks, the recomputes and the graph-task callbacks (rule 3).
2. The holds and the graph task books sit under HoldLedger.lock, taken only where an engine a
   checkpoint ran in reaches them (rule 7): a model spread over devices runs two device threads'
   hooks at once, and apply(), revert() and the diagnostics read them from any thread. A backward
   fetch or release writes its own module's key in an open task's due without it (one dict
   operation, atomic), and a fetch adds its engine to the task's engines_noted once its
   coordinator is noted there; readers copy due whole (atomic) before they iterate it, and
   Leftovers.nothing_below reads that copy and whether the task holds anything (one dict read)
   before the lock, which below takes if either shows something.
3. Rule 5's counts and the forward watch's notes (in each module's __dict__, NOTE [ Notes on the
   module ]), the engine facts, kept storage's flag and the watch's findings are plain dicts and
   flags without a lock: one key is written by one thread at a time (a module's backward follows
   its forward, a call's note is read by its own release on its thread, and one module's calls
   never overlap on two threads in a graph task), and a dict operation is atomic.
4. A finalizer runs on whichever thread frees its object, and only appends to a deque or pops a key.
"""
import functools
import sys
import threading
from typing import List, NamedTuple, Tuple

import torch

from zero3_recompute import deferral, kept_storage, live_budget, module_notes, placeholders
from zero3_recompute.deferral import FetchDeferral
from zero3_recompute.engines import Engines
from zero3_recompute.forward_watch import ForwardWatch
from zero3_recompute.graph_tasks import GraphTaskBooks
from zero3_recompute.holds import CallsDue, HoldRegistry, HoldTaking, restore_gathered
from zero3_recompute.kept_storage import KeptStorage
from zero3_recompute.leftovers import Leftovers, ReleaseLate
from zero3_recompute.live_budget import LiveBudget
from zero3_recompute.placeholders import Placeholders
from zero3_recompute.policies import HOLD_ALL, PLACEHOLDER, Policy
from zero3_recompute.targets import RECOMPUTATION_PACK_HOOKS, RECOMPUTE_FRAMES, Targets, has_children, named_in


def recompute_under_way() -> bool:
    """Whether this thread is inside a checkpoint's unpack hook (targets.RECOMPUTE_FRAMES): a
    recompute, or its metadata check, may still be to come on the way out. A caller that read a
    recompute's own pack hook (targets.RECOMPUTATION_PACK_HOOKS) knows without this walk."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name, frame.f_globals.get("__name__")) in RECOMPUTE_FRAMES:
            return True
        frame = frame.f_back
    return False


class ReleasePlan(NamedTuple):
    """What the wrapper does around one recompute release (rule 1)."""
    held: List[torch.nn.Parameter]
    # Each held param of a module deepspeed treats as a leaf, and its gathered data: its fast leaf
    # path swaps param.data for a 1-element buffer even for params it keeps (holds.restore_gathered).
    gathered: List[Tuple[torch.nn.Parameter, torch.Tensor]]
    placeholder_candidates: List[torch.nn.Parameter]
    graph_task: int


NOTHING_HELD = ReleasePlan([], [], [], -1)  # shared by every release that holds nothing; read only
# ReleasePlan from one tuple of its fields, without the Python frame of NamedTuple's __new__.
new_plan = functools.partial(tuple.__new__, ReleasePlan)


class HoldLedger:
    """The core's state: holds by module, calls due by module, and the graph task books."""

    def __init__(self, targets: Targets, policy: Policy, layers_off: Tuple[str, ...] = ()):
        self._targets = targets
        self.policy = policy
        self.lock = threading.RLock()  # around the core's state; re-entrant: switch_policy() releases under it
        self.holds, self.notes = HoldRegistry(), module_notes.new_keys()  # notes: NOTE [ Notes on the module ]
        self.calls_due = CallsDue(self.notes.calls_due)
        self.engines = Engines(targets.saved_tensors)
        self.books = GraphTaskBooks(self.sweep, self.engines.books_touched,  # under the lock
                                    targets.coordinator_of, targets.coordinator_per_engine)
        self.kept_storage = KeptStorage(targets, enabled=kept_storage.LAYER not in layers_off)
        self.deferral = FetchDeferral(targets) if deferral.LAYER not in layers_off else None
        self.placeholders = Placeholders(targets, recompute_under_way) if placeholders.LAYER not in layers_off else None
        self.budget = LiveBudget(targets.live_numel) if targets.live_numel else None  # None: switched off
        self.watch = ForwardWatch(targets, self.deferral, self.kept_storage, self.notes.output)
        self._late = ReleaseLate(targets, self.kept_storage, self.drop_holds)
        self.leftovers = Leftovers()
        self._settle, self._top_pack_hook = targets.saved_tensors.settle, targets.saved_tensors.top_pack_hook  # hot
        self.retired = False  # by retire() (revert()): the wrappers then pass every call through
        self._take_up_policy()

    def _take_up_policy(self) -> None:
        """The policy's mechanics (rule 1), and its deferral, for the ledger and the watch alike."""
        self.taking = HoldTaking(self._targets, self.policy, self.placeholders is not None, self.budget, self.books,
                                 self.holds, self.lock)
        self.defers_fetches = self.watch.defers = (self.deferral is not None
                                                   and self.policy.under_saved_tensors_hooks == PLACEHOLDER)

    # Rules 1, 5 and 6: around a recompute's release.

    def before_recompute_release(self, offload, module) -> ReleasePlan:
        graph_task = torch._C._current_graph_task_id()
        if self.defers_fetches:
            self.deferral.rerun(module)
        task = self.books.tasks.get(graph_task)
        if task is not None and id(module) in task.due:  # rule 6
            self.watch.output_needs_grad(module, graph_task)
            return new_plan((*self.taking.take(offload, module, graph_task, HOLD_ALL, frozen_only=False), graph_task))
        pack = self._top_pack_hook()
        under_hooks = pack is not None
        if torch.is_grad_enabled() and not (  # rule 5: a non-reentrant recompute's graph is never backpropagated
                under_hooks and (named_in(pack, RECOMPUTATION_PACK_HOOKS) or recompute_under_way())):
            notes, due_key = module.__dict__, self.calls_due.key  # rule 5's add (CallsDue.add), without its frame
            notes[due_key] = notes.get(due_key, 0) + 1
        noted = module.__dict__.pop(self.notes.output, None)  # ForwardWatch.output_needs_grad, without its frame
        if not (torch.is_grad_enabled() if noted is None or noted[0] != graph_task else noted[1]):
            return NOTHING_HELD  # autograd saved nothing of M, and M's backward hooks will not fire
        if under_hooks and module.__dict__.get(self.calls_due.key, 0) <= 0:  # not in calls_due, without its frame
            return NOTHING_HELD  # M's backward ran before this recompute replays it: nothing reads what it stores
        mechanics = self.taking.under_hooks if under_hooks else self.taking.without_hooks
        if mechanics is None:
            return NOTHING_HELD  # stock's release
        held, gathered, candidates = self.taking.take(offload, module, graph_task, mechanics)
        if not (held or candidates):
            return NOTHING_HELD  # nothing frozen gathered
        return new_plan((held, gathered, candidates, graph_task))

    def after_recompute_release(self, plan: ReleasePlan) -> None:
        if plan.gathered:
            restore_gathered(plan.gathered)
        if plan.placeholder_candidates:
            entries = self.placeholders.put(plan.placeholder_candidates)
            if entries:
                with self.lock:
                    self.books.open(plan.graph_task).placeholders.extend(entries)

    # Forward, outside any backward.

    def forward_fetching(self, offload, module) -> None:
        """The root's fetch (the caller's test): rule 4 first, then the watch of a training forward for kept storage."""
        self.engines.forward_noted.discard(id(offload))  # a forward begins (the last may have raised)
        if torch._C._current_graph_task_id() != -1:
            return
        if self.books.any_left():
            self.close_ended(self._targets.coordinator_of(offload, module))
        if torch.is_grad_enabled():
            self.watch.training_forward(offload, self.engines.checkpointing(offload))

    def forward_done(self, offload, module) -> None:
        """A forward release: rule 5's count, and what the engines, the deferral and the watch note."""
        if self._settle is not None:  # NOTE [ Reading the saved-tensors hook stack ]
            self._settle()
        if self.books.queued:
            self.close_ended()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self.calls_due.add(module)
        if id(offload) in self.engines.forward_noted and module is not offload.module and not self.defers_fetches:
            return  # what follows would note nothing more before the root's release
        pack = self._top_pack_hook() if grad_enabled else None
        checkpointed = self.engines.forward_released(offload, module, grad_enabled, pack is not None)
        known = self.engines.checkpointing(offload)  # before this forward, or since its root's release
        if grad_enabled and (checkpointed or known):  # forward watch NOTE, rule 3
            self.watch.hooks.arm(offload.module, check=not known)
        self.watch.forward_released(offload, module, grad_enabled, pack, self.defers_fetches)
        if checkpointed and not self.defers_fetches and self.watch.watching(offload):
            self.engines.forward_noted.add(id(offload))  # the deferral notes every call: never with it

    # Rules 2 and 3: backward fetch and release, and the sweep.

    def backward_fetched(self, offload, module) -> bool:
        """``module``'s backward release is now due; True where its fetch is deferred."""
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1 or id(offload) not in self.engines.recomputing:
            return False  # rule 7
        task = self.books.tasks.get(graph_task)
        if task is not None and task.placeholders:
            self.placeholders.unveil(task, self.lock)
        if task is None or id(offload) not in task.engines_noted:
            task = self.books.note_fetch(graph_task, task, offload, module, self.lock)
        task.due[id(module)] = (offload, module)  # one key of an open task: no lock (NOTE, rule 2)
        return self.defers_fetches and self.deferral.take(offload, module)

    def drop_holds(self, module) -> None:
        """Rule 2, right before ``module``'s late backward release: its tokens go; rule 5's count too."""
        self.calls_due.take(module)
        task = self.books.tasks.get(torch._C._current_graph_task_id())
        if task is not None:
            task.due.pop(id(module), None)  # one key of an open task: no lock (NOTE, rule 2)
        if id(module) in self.holds.by_module:
            self.holds.drop(id(module), self.lock)

    def before_backward_release(self, offload, module) -> None:
        """Rule 2, right before ``module``'s backward release: late ones below it first, then its tokens go.
        The backward release's wrapper makes the case of an open task without placeholders itself."""
        notes, due_key = module.__dict__, self.calls_due.key  # rule 5's take (CallsDue.take), without its frame
        count = notes.get(due_key)
        if count:
            notes[due_key] = count - 1
        if not self.holds.by_module and not self.books.tasks:
            return
        graph_task = torch._C._current_graph_task_id()
        task = self.books.tasks.get(graph_task)
        if task is not None and task.placeholders:
            self.placeholders.unveil(task, self.lock)
        if has_children(module) and not self.leftovers.nothing_below(offload, module, task, self.holds, graph_task):
            self.release_below(offload, module, task, graph_task)
        if task is not None:
            task.due.pop(id(module), None)  # one key of an open task: no lock (NOTE, rule 2)
        if id(module) in self.holds.by_module:
            self.holds.drop(id(module), self.lock)

    def release_below(self, offload, module, task, graph_task: int) -> None:
        """Rule 2: the modules and holds below ``module`` that will never get a backward release, released late."""
        with self.lock:
            due, orphans = self.leftovers.below(offload, module, task, self.holds, graph_task)
        self._late.release(due)
        self._late.release_holds(orphans)

    def sweep(self, graph_task: int) -> None:
        """Rule 3 (and 4): what ``graph_task`` left, released when it ends; once."""
        with self.lock:
            closed = self.books.close(graph_task)
            if not closed:
                return
            due, left = list(closed[0].due.values()), closed[0].placeholders
        self._late.release(due[::-1])  # last fetched first, as a backward releases (rule 2)
        with self.lock:
            ended = self.holds.take_ended(graph_task)
        self._late.release_holds(ended)
        placeholders.restore(left)

    def close_ended(self, coordinator=None) -> None:
        """Rule 4, on the training thread outside any backward."""
        if torch._C._current_graph_task_id() != -1:
            return
        with self.lock:
            ended, engines = self.books.ended(coordinator)
        for graph_task in ended:
            self.sweep(graph_task)
        self._late.release_prefetched(engines, coordinator)

    def switch_policy(self, policy: Policy, retire: bool = False) -> None:
        """The old policy's holds released, then ``policy`` in force; ``retire`` (revert()): the wrappers pass all."""
        with self.lock:
            if self.policy is not policy or retire:
                self.engines.forward_noted.clear()  # the deferral may come into force
                self.retired = self.retired or retire
                if retire:
                    self.watch.hooks.disarm()  # forward watch NOTE, rule 3
                self.release_everything()
                self.policy = policy
                self._take_up_policy()

    def release_everything(self) -> None:
        """Every hold dropped and released, every placeholder restored (revert(), a new policy)."""
        with self.lock:
            closed = self.books.close(None)
            ended = self.holds.take_all()
            if self.deferral is not None:
                self.deferral.clear()
        self._late.release_holds(ended)
        placeholders.restore([entry for task in closed for entry in task.placeholders])


def layers_in_force(ledger: HoldLedger) -> Tuple[str, ...]:
    """The layers over the core in force in ``ledger``."""
    on = ((placeholders.LAYER, ledger.placeholders), (deferral.LAYER, ledger.deferral),
          (kept_storage.LAYER, ledger.kept_storage if ledger.kept_storage.enabled else None),
          (live_budget.LAYER, ledger.budget))
    return tuple(name for name, layer in on if layer is not None)
