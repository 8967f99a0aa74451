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

1. Before and after the recompute's release of module M. A policy (zero3_recompute.policies)
   decides, for M's frozen params that stock would consider (not external, AVAILABLE):
   - Exempt first, under every policy: when M's output needs no grad (k/v projections over a
     frozen encoder's output, a branch over a detached input), autograd saved nothing of M,
     so stock's release is safe and M's backward hooks will never fire: release as stock
     does. A module forward hook notes whether each output needs grad; unknown counts as
     needed. It is registered with a graph task's books (step 3) and removed when no graph
     task is on the books: a model that no checkpoint ran in never sees it.
   - Exempt too, under a saved-tensors hook: M has no call whose backward release is still to
     come (each call that builds a graph counts one, each backward release takes one). Its
     backward ran before the recompute that replays it (a backward that saved nothing, with
     early stop off or deepspeed's checkpoint, which replay whole blocks): nothing will read
     what the recompute stores of M, and a hold would last until the graph task ends, one per
     block. Release as stock does.
   - Is the recompute under a saved-tensors hook? torch's non-reentrant checkpoint and
     deepspeed's non_reentrant_checkpoint recompute under one, and it may store the very
     Parameter: a release would shrink what it stored. Reentrant recompute has none:
     autograd keeps its own reference, and stock trains there. The hook in force is read as
     NOTE [ Reading the saved-tensors hook stack ] (zero3_recompute.hook_stack) says.
   - HOLD (keep; auto under a hook): except for params swapped to NVMe, which get a
     PLACEHOLDER instead (the swapper frees a param's swap-in buffer only when it is
     partitioned, and holding more params than it has buffers makes swap_in assert), a
     hold token for M goes into param.ds_active_sub_modules.
     Stock's release removes M's id, sees a non-empty set and leaves the param gathered, on
     every deepspeed we support. The fast leaf-module path also swaps param.data for a
     1-element buffer; for held params whose data shrank we put the gathered tensor back.
   - PLACEHOLDER (release, under a hook): stock's release runs, then each frozen param it
     partitioned gets a placeholder of its full shape, a view of one NaN element shared by
     every placeholder of its dtype and device, so the checkpoint's metadata check passes.
     The check runs inside the checkpoint's unpack hook, right after the recompute
     (targets.RECOMPUTE_FRAMES). At the first backward fetch or release on that thread once
     it is out of every such hook, stock's partitioned tensor goes back: from then on the
     param is exactly as stock leaves it, and a read before its module's fetch fails as it
     does on stock, whatever the dtype or loss scaling. M's pre-backward fetch gathers it
     before any of M's backward nodes reads it. When the graph task ends, stock's tensor
     goes back wherever a placeholder is still in place.
   - STOCK (auto and release without a hook): stock's release, unchanged.
   If M's own backward is under way (its backward fetch fired in this graph task, its
   backward release has not: with checkpoint early stop off, M's backward can trigger a
   recompute that runs M's forward to its end), every param of M is held, trainable ones
   too, under every policy. Both fetches are recorded under M's id, so the recompute's
   release would otherwise cancel the backward's claim and partition params M's backward
   is about to use.
2. Fetch and release by the owner. M's pre-backward fetch finds a held param AVAILABLE (no
   all-gather). Under release, the fetch of a module whose last forward ran inside a
   non-reentrant checkpoint (its pack hook is one of targets.CHECKPOINT_PACK_HOOKS: torch's
   or deepspeed's, whose recompute reruns whole module calls) and that no recompute has
   rerun since, in any graph task, is deferred when all its params are frozen, not
   persistent and not on NVMe (and ZenFlow is off): this module's backward is about to start
   that recompute, since a backward formula reads only saved tensors, and the recompute
   gathers it, notes its backward as under way (step 1: held) or stops inside its forward
   (early stop), so one gather serves both. Fetched at once instead, it would stay gathered
   while the recompute gathers the others, two modules at once. The deferral holds whatever
   the params' status (deepspeed records each fetch in its module trace, and a step that
   fetched where the recording step deferred would invalidate it), and only a forward with
   grad enabled sets or clears it. Nothing in M's backward may read M's params other than
   through tensors autograd saved: a module whose call ran a Python autograd Function that
   may keep them on its ctx (bitsandbytes' 4-bit matmul) is never deferred (NOTE [ Params
   read outside saved tensors ], zero3_recompute.autograd_reads); a backward hook that reads
   module.weight must not run under release. It is safe under prefetch: a param of M that a
   prefetch left in flight is waited for by the recompute's pre-forward fetch of M, which
   precedes every read of M's saved tensors, on the thread and stream that then run M's
   backward. On 0.19.3+ the skipped fetch leaves M out of the coordinator's active-backward
   record; only deepspeed's own handling reads it, and it is switched off, and the record's
   non-empty assertion at a backward release holds through M's ancestors (the root's fetch
   comes first). Checked on CPU under deepspeed's default prefetch: the scenario matrix and
   the random trees.
   Right before M's post-backward release, the descendants of M that will never see a backward
   release of their own get it (M still in deepspeed's active-backward record), then the hold
   tokens of M are removed, so that release partitions the param exactly as stock would have
   there. The descendants released so are modules
   called with keyword arguments only, or fed inputs that need no grad (ZeRO counts a
   module's positional inputs that need grad, ds_grads_remaining, and releases when the last
   one's grad arrives). Stock keeps what their backward fetch gathered until step(); here a
   block's leftovers go when the block's backward ends, so nothing held grows with depth.
3. Sweep. Whatever is left when the graph task ends. A graph task gets books of its own
   with the first backward fetch of an engine whose training forward ran a module a
   checkpoint may recompute (one without grad, or under a saved-tensors hook), or with the
   first hold or placeholder. Every module whose backward fetch fires in a graph task with
   books is noted, and un-noted by its backward release. With the books, a callback is queued
   on that graph task (queue_callback). It runs when that backward ends, whoever started it (engine.backward or
   loss.backward()): it gives each noted module the backward release it missed (stock's own,
   late), drops every hold still taken in that task and releases those params through the
   coordinator, so its bookkeeping of available numel stays right, and restores
   placeholders. A hold belongs to every graph task that took it: the end of a nested one (a
   reentrant checkpoint's inner backward) releases nothing that an enclosing task still holds.
4. A backward that raises never runs its callback, and its sweep runs on the training thread,
   never on the thread that frees the graph task (with CUDA nodes, an autograd device thread,
   after the caller holds the exception, racing the next step). Each graph task's books are
   one object (_GraphTask) that records the coordinators it touched. Before the next forward's
   root fetch, and before a coordinator's reset_step, outside any backward, the sweep runs
   for every graph task still on the books for that coordinator: its backward is over. Then
   what that backward's prefetch gathered for modules it never reached is released. torch
   drops the callback with the graph task, and with it the only reference to an object whose
   finalizer then only queues the task, for the next root fetch or forward release outside a
   backward to sweep; a task already swept is not swept again. Each graph task cleans up after itself
   alone; a forward, or a backward, on another thread or of another engine never touches it.

So under keep a frozen param is gathered twice per step (forward and recompute) instead of
three times, and it lives from the recompute until its own module's backward, at most until
the backward of the nearest enclosing module that gets one. Under release it is gathered
three times (twice for the module whose backward starts the recompute) and lives as in a
run without checkpointing. Persistent params are held too, since stock partitions them as
well while it records its first step's module trace; the sweep only drops their tokens, as
they are meant to stay resident. Trainable params (but
for the in-backward case of step 1), external params, and every release outside a backward
graph task (eval, torch.no_grad forwards) take stock's path unchanged. A backward of an engine
that no checkpoint ran in opens no books: nothing is recorded or registered, and every fetch and
release is stock's (on 0.19.3+ deepspeed's own end-of-backward sweep included, for a coordinator
no backward with books touched). In a backward with books, steps 2 and 3 give a module whose backward
release never fires (keyword-only calls, no-grad inputs) that release at the end of its
enclosing module's backward, or of the graph task, where stock keeps it gathered until step().
One more change reaches forward releases: a gathered storage kept alive outside saved tensors
is freed there and refilled at the next fetch (NOTE [ Gathered storage kept outside saved
tensors ], zero3_recompute.kept_storage).
"""
import collections
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch

from zero3_recompute.autograd_reads import FOUND, NONE, output_needs_grad, walk_module_call
from zero3_recompute.kept_storage import KeptStorage
from zero3_recompute.policies import HOLD, PLACEHOLDER, Policy
from zero3_recompute.targets import Targets, reruns_module_calls, swapped_to_nvme


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
    # Every graph task that held these params: a nested one (a reentrant checkpoint's inner
    # backward, an autograd.grad inside a backward) adds itself, and its end releases nothing
    # an enclosing task still holds.
    graph_tasks: Set[int]
    module: "weakref.ref[torch.nn.Module]"
    params: List[torch.nn.Parameter] = field(default_factory=list)


@dataclass
class ReleasePlan:
    """What the wrapper does around one recompute release (step 1)."""
    held: List[Tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    placeholder_candidates: List[torch.nn.Parameter] = field(default_factory=list)
    graph_task: int = -1


@dataclass
class _Placeholder:
    param: torch.nn.Parameter
    placeholder: torch.Tensor
    partitioned: torch.Tensor
    # The thread that made it inside a checkpoint's unpack hook, which unveils it once out of
    # every such hook (step 1); None: kept until the sweep.
    unveiled_by: Optional[int]


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.data_ptr() == b.data_ptr()


class HoldLedger:
    """The frozen params held since a recompute, by owning module, and the books of each open
    backward graph task (_GraphTask). See NOTE above."""

    def __init__(self, targets: Targets, policy: Policy):
        self._targets = targets
        self.policy = policy
        # Re-entrant: switch_policy() and retire() release everything while holding it.
        self._lock = threading.RLock()
        self._by_module: Dict[int, _Holds] = {}
        # graph task id -> what that graph task put on the books (steps 3 and 4).
        self._tasks: Dict[int, _GraphTask] = {}
        # Ids of graph tasks that torch freed without running their callback (a backward that
        # raised), queued by their finalizers for the training thread (step 4).
        self._ended: "collections.deque[int]" = collections.deque()
        # id(child) -> id(parent), per model, for step 2's descendants. Ids only: a reference to
        # a module here would keep the model (the dictionary's own key) alive for good.
        self._parents: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[int, int]]" = weakref.WeakKeyDictionary()
        # Per thread, for one graph task at a time: id(module) -> whether its output needs grad
        # (step 1's exemption).
        self._outputs = threading.local()
        self._output_hook = None
        # (dtype, device) -> the one element every placeholder of that dtype and device views.
        self._cells: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # The engines (DeepSpeedZeRoOffload) whose training forward ran a module that a checkpoint
        # may recompute: one without grad (reentrant checkpointing, deepspeed's) or under a
        # saved-tensors hook (non-reentrant). Only their backwards open books (steps 3 and 4); a
        # model no checkpoint ran in takes stock's path (NOTE, last paragraph). Kept for good:
        # whether a backward may recompute is known only once it does.
        self._checkpointing: "weakref.WeakSet" = weakref.WeakSet()
        # Ids of engines whose forward under way ran such a module; the root module's release
        # ends that forward and adds the engine to _checkpointing if it ran with grad (an eval
        # forward makes no backward).
        self._forward_checkpointed: Set[int] = set()
        # The coordinators a graph task with books touched: their deepspeed end-of-backward sweep
        # (0.19.3 on) stays switched off; any other coordinator's backward is stock's throughout.
        self._coordinators_with_books: "weakref.WeakSet" = weakref.WeakSet()
        # Step 2's deferred fetch (release policy): True while a module's last forward ran
        # inside a checkpoint (CHECKPOINT_PACK_HOOKS) outside any backward, and no recompute
        # has rerun it since, in any graph task (a reentrant checkpoint's backward is a graph
        # task of its own), nor was its fetch deferred since.
        self._recompute_pending: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()
        # Step 1's rule: per module, its calls whose backward release is still to come. Each call
        # that builds a graph counts one (a grad-enabled forward, a reentrant recompute), each
        # backward release (stock's, or late) takes one. A module's non-reentrant recompute release
        # with none to come holds nothing. Counted for every engine from the first forward: an
        # engine is known to checkpoint only once its first forward ends, and a count too high
        # only holds as before.
        self._backward_calls_due: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
        # Per thread, for the forward under way: the modules with only frozen params that the
        # module forward hook saw build a graph read through saved tensors alone (NOTE [ Params
        # read outside saved tensors ]), until their forward release takes them.
        self._forwards = threading.local()
        # Storages kept alive outside saved tensors, freed and refilled (NOTE [ Gathered storage
        # kept outside saved tensors ]), and the ids of the engines whose training forward under way
        # the module forward hook watches for it.
        self.kept_storage = KeptStorage(targets)
        self._watching: Set[int] = set()
        # Set by retire() (revert()): the wrappers then pass every call to deepspeed's methods.
        self.retired = False
        self._sync_output_hook()

    @property
    def defers_fetches(self) -> bool:
        return self.policy.under_saved_tensors_hooks == PLACEHOLDER

    def _under_saved_tensors_hooks(self) -> bool:
        """Whether a saved-tensors hook is in force (NOTE [ Reading the saved-tensors hook stack ])."""
        return self._targets.saved_tensors.top_pack_hook() is not None

    def held_params(self) -> List[torch.nn.Parameter]:
        with self._lock:
            return [param for holds in self._by_module.values() for param in holds.params]

    def keeps_books_for(self, coordinator) -> bool:
        """Whether a backward that used ``coordinator`` ever had books (steps 3 and 4)."""
        return coordinator in self._coordinators_with_books

    def graph_tasks_on_the_books(self) -> int:
        """How many graph tasks have books open (each with its callback and finalizer)."""
        with self._lock:
            return len(self._tasks)

    # Step 1: around the recompute's post-forward release.

    def _sync_output_hook(self) -> None:
        """The module forward hook, registered while a graph task has books, while release
        watches training forwards (NOTE [ Params read outside saved tensors ]), or from the first
        checkpointed training forward on (NOTE [ Gathered storage kept outside saved tensors ]).
        Call with the lock held."""
        wanted = not self.retired and (bool(self._tasks) or self.defers_fetches or bool(self._watching))
        if wanted and self._output_hook is None:
            self._output_hook = self._targets.register_forward_hook(self._record_output)
        elif not wanted and self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None

    def _record_output(self, module, inputs, output) -> None:
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1:
            if self._watching or self.defers_fetches:
                self._watch_forward(module, inputs, output)
            return
        if getattr(self._outputs, "graph_task", None) != graph_task:
            self._outputs.graph_task, self._outputs.needs_grad = graph_task, {}
        self._outputs.needs_grad[id(module)] = output_needs_grad(output)

    def _watch_forward(self, module, inputs, output) -> None:
        """A module call of a training forward under a checkpoint that reruns module calls, read
        by one walk of the graph it built: under release, whether its backward reads its frozen
        params only through saved tensors (NOTE [ Params read outside saved tensors ]); while a
        forward is watched, whether a Python Function may keep their gathered storage (NOTE
        [ Gathered storage kept outside saved tensors ])."""
        found = None
        if torch.is_grad_enabled() and self._inside_rerunning_checkpoint():
            # A module's own params, not deepspeed's iter_params: the hook sees every module's call,
            # also of models deepspeed does not manage (a reference model), whose params have no ds_id.
            params = list(module.parameters(recurse=self._targets.is_leaf_module(module)))
            frozen = sum(1 for param in params if not param.requires_grad and hasattr(param, "ds_id"))
            all_frozen = bool(params) and frozen == len(params)
            if frozen and (self._watching or (self.defers_fetches and all_frozen)):
                found = walk_module_call(inputs, output, self._targets.python_function_class)
            if self.defers_fetches and all_frozen and found == NONE:
                if getattr(self._forwards, "saved_only", None) is None:
                    self._forwards.saved_only = weakref.WeakSet()
                self._forwards.saved_only.add(module)
        if self._watching:
            self.kept_storage.note_call(module, output if found == FOUND else None)

    def _inside_rerunning_checkpoint(self) -> bool:
        return reruns_module_calls(self._targets.saved_tensors.top_pack_hook())

    def _read_through_saved_only(self, module) -> bool:
        """Whether the forward hook saw ``module``'s call just ended read its params through saved
        tensors alone; taken once. Unwatched counts as not."""
        watched = getattr(self._forwards, "saved_only", None)
        if watched is None or module not in watched:
            return False
        watched.discard(module)
        return True

    def _output_needs_grad(self, module) -> bool:
        """Recorded for this call of ``module`` in this graph task; unknown counts as needed."""
        if getattr(self._outputs, "graph_task", None) != torch._C._current_graph_task_id():
            return True
        return self._outputs.needs_grad.pop(id(module), None) is not False

    def _books(self, graph_task: int) -> "_GraphTask":
        """The books of ``graph_task``, opened once: step 3's sweep queued on it, step 4's
        finalizer armed, module outputs watched while any graph task is open. Opened by the
        first backward fetch of an engine a checkpoint ran in, or by a recompute's hold or
        placeholder. Call with the lock held."""
        task = self._tasks.get(graph_task)
        if task is not None:
            return task
        task = self._tasks[graph_task] = _GraphTask()
        self._sync_output_hook()
        end = _GraphTaskEnd()
        task.finalizer = weakref.finalize(end, self._ended.append, graph_task)
        task.finalizer.atexit = False
        torch.autograd.Variable._execution_engine.queue_callback(lambda: (end, self.sweep(graph_task)))
        return task

    def _close(self, graph_task: Optional[int]) -> List["_GraphTask"]:
        """Take ``graph_task``'s books off (every task's, for None); call with the lock held."""
        if graph_task is None:
            closed, self._tasks = list(self._tasks.values()), {}
        else:
            closed = [task for task in (self._tasks.pop(graph_task, None), ) if task is not None]
        for task in closed:
            task.finalizer.detach()
        self._sync_output_hook()
        return closed

    def close_ended(self, coordinator=None) -> None:
        """Step 4, on the training thread outside any backward: sweep every graph task whose
        finalizer queued it, and, before ``coordinator`` resets its step, every graph task still
        on the books for that coordinator: its backward is over (it raised), whatever thread
        torch frees it on, and later."""
        if torch._C._current_graph_task_id() != -1:
            return
        ended = []
        while self._ended:
            ended.append(self._ended.popleft())
        engines = {}
        if coordinator is not None:
            with self._lock:
                for key, task in self._tasks.items():
                    if id(coordinator) in task.coordinators:
                        ended.append(key)
                        engines.update((id(offload), offload) for offload, _ in task.due.values())
        for graph_task in ended:
            self.sweep(graph_task)
        for offload in engines.values():
            if self._targets.coordinator_of(offload, offload.module) is coordinator:
                self._release_prefetched(offload, coordinator)

    def _release_prefetched(self, offload, coordinator) -> None:
        """Step 4: what a raised backward's prefetch gathered for modules it never reached, released
        before the coordinator's reset_step zeroes its count of available numel (a release after it
        would drive that count negative)."""
        available = self._targets.available_status
        with torch.no_grad():
            for param in self._targets.iter_params(offload.module, recurse=True):
                if (param.ds_status == available and not param.ds_active_sub_modules
                        and not getattr(param, "ds_persist", False) and not getattr(param, "is_external_param", False)):
                    self._targets.release_param(coordinator, param)

    def _holdable(self, param) -> bool:
        return (not getattr(param, "is_external_param", False)
                and param.ds_status == self._targets.available_status)

    def before_release(self, offload, module) -> ReleasePlan:
        """Step 1 of the NOTE, before stock's release of ``module`` inside a graph task."""
        targets = self._targets
        graph_task = torch._C._current_graph_task_id()
        plan = ReleasePlan(graph_task=graph_task)
        if self.defers_fetches:
            with self._lock:
                self._recompute_pending[module] = False
        params = [param for param in targets.iter_params(module, recurse=targets.is_leaf_module(module))
                  if self._holdable(param)]
        task = self._tasks.get(graph_task)
        if task is not None and id(module) in task.due:
            self._output_needs_grad(module)
            plan.held = self._hold(offload, module, params, graph_task)
            return plan
        under_hooks = self._under_saved_tensors_hooks()
        if torch.is_grad_enabled() and not (under_hooks and self._targets.recompute_under_way()):
            # A call whose graph's backward follows: a reentrant recompute, or a checkpoint's first
            # forward inside one. A non-reentrant recompute's graph is never backpropagated.
            self._count_backward_call(module)
        frozen = [param for param in params if not param.requires_grad]
        if not self._output_needs_grad(module) or not frozen:
            return plan
        if under_hooks and not self._backward_calls_due.get(module, 0):
            # Its backward already ran in this graph task (a backward that saved nothing, before the
            # recompute that replays it): nothing will read what the recompute stores of it.
            return plan
        action = self.policy.action(under_hooks)
        if action == HOLD:
            # A param swapped to NVMe returns its swap-in buffer only when partitioned, and the
            # swapper has a few (buffer_count, 5 by default): holding could exhaust them.
            kept = []
            for param in frozen:
                (plan.placeholder_candidates if swapped_to_nvme(param) else kept).append(param)
            plan.held = self._hold(offload, module, kept, graph_task)
        elif action == PLACEHOLDER:
            plan.placeholder_candidates = frozen
        return plan

    def _hold(self, offload, module, params, graph_task: int) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
        if not params:
            return []
        with self._lock:
            holds = self._by_module.get(id(module))
            if holds is None:
                holds = _Holds(RecomputeHold(type(module).__name__), None, set(), weakref.ref(module))
                self._by_module[id(module)] = holds
            holds.coordinator = self._targets.coordinator_of(offload, module)
            holds.graph_tasks.add(graph_task)
            self._coordinators_with_books.add(holds.coordinator)
            for param in params:
                if holds.token not in param.ds_active_sub_modules:
                    param.ds_active_sub_modules.add(holds.token)
                    holds.params.append(param)
            self._books(graph_task).coordinators.add(id(holds.coordinator))
        return [(param, param.data) for param in params]

    def after_release(self, plan: ReleasePlan) -> None:
        """Step 1 of the NOTE, after stock's release."""
        for param, gathered in plan.held:
            # The fast leaf path swaps param.data for a 1-element buffer even for params it
            # kept; put the gathered tensor back, and only then (ZenFlow, say, transposes
            # param.data in place of a release: same numel, and not ours to undo).
            if param.data.numel() < gathered.numel() and not _same_tensor(param.data, gathered):
                param.data = gathered
        left = [param for param in plan.placeholder_candidates if param.ds_status != self._targets.available_status]
        if not left:
            return
        unveiled_by = threading.get_ident() if self._targets.recompute_under_way() else None
        entries = []
        with self._targets.outside_dispatch_modes():
            for param in left:
                entries.append(_Placeholder(param, self._placeholder_for(param), param.data, unveiled_by))
                param.data = entries[-1].placeholder
        with self._lock:
            self._books(plan.graph_task).placeholders.extend(entries)

    def _placeholder_for(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A view of the param's full shape over one shared element per dtype and device (no
        allocation per param): NaN where the dtype has one. Made outside any torch dispatch mode:
        selective activation checkpointing replays the forward's ops during the recompute and
        refuses any op it did not record (these are not the user's ops)."""
        key = (param.dtype, param.device)
        cell = self._cells.get(key)
        if cell is None:
            fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
            cell = self._cells.setdefault(key, torch.full((), fill, dtype=param.dtype, device=param.device))
        # A 0-dim cell expands to every shape, () included (a frozen scale or temperature).
        return cell.expand(tuple(param.ds_shape))

    def _unveil(self, graph_task: int) -> None:
        """Step 1: once this thread is out of every checkpoint unpack hook, the recompute that
        made its placeholders in ``graph_task``, and the metadata check after it, are over. The
        params get stock's partitioned tensor back, so a read before their module's fetch fails
        as it does on stock."""
        task = self._tasks.get(graph_task)
        if task is None or not task.placeholders:
            return
        thread = threading.get_ident()
        if not any(entry.unveiled_by == thread for entry in task.placeholders) or self._targets.recompute_under_way():
            return
        with self._lock:
            ready = [entry for entry in task.placeholders if entry.unveiled_by == thread]
            task.placeholders = [entry for entry in task.placeholders if entry.unveiled_by != thread]
        _restore(ready)

    # Step 2 and 3: backward fetch and release.

    def forward_done(self, offload, module) -> None:
        """A forward release outside any backward: notes whether ``module`` ran inside a
        checkpoint, for step 2's deferred fetch; a no-grad forward makes no backward and
        changes nothing. The hook-stack reader settles here first (NOTE [ Reading the
        saved-tensors hook stack ]), so nothing of a backward that ended reaches the next."""
        self._targets.saved_tensors.settle()
        if self._ended:
            self.close_ended()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._count_backward_call(module)
        pack = self._targets.saved_tensors.top_pack_hook() if grad_enabled else None
        rerunning = grad_enabled and reruns_module_calls(pack)
        if module is offload.module:
            if grad_enabled and (pack is not None or id(offload) in self._forward_checkpointed):
                self._checkpointing.add(offload)
            self._forward_checkpointed.discard(id(offload))
            self.kept_storage.forward_ended()
            self._watch_training_forward(offload, False)
        else:
            if not grad_enabled or pack is not None:
                self._forward_checkpointed.add(id(offload))
            if rerunning:
                self._watch_training_forward(offload, True)
        if self.defers_fetches and grad_enabled:
            # Inside the forward of a checkpoint whose recompute reruns whole module calls, and
            # read in backward through saved tensors alone (NOTE [ Params read outside saved tensors ])?
            pending = self._read_through_saved_only(module) and rerunning
            with self._lock:
                self._recompute_pending[module] = pending

    def forward_fetching(self, offload, module) -> None:
        """Before a forward fetch. The root's, outside any backward, first sweeps what a raised
        backward of its coordinator left (step 4), before this forward gathers anything: on
        deepspeed before 0.16 reset_step comes at the end of backward, not here. In a training
        forward of an engine a checkpoint ran in, it then starts the watch of NOTE [ Gathered
        storage kept outside saved tensors ]."""
        if module is not offload.module or torch._C._current_graph_task_id() != -1:
            return
        if self._tasks or self._ended:
            self.close_ended(self._targets.coordinator_of(offload, module))
        if offload in self._checkpointing and torch.is_grad_enabled():
            self._watch_training_forward(offload, True)

    def _watch_training_forward(self, offload, watch: bool) -> None:
        if not self.kept_storage.enabled or (id(offload) in self._watching) == watch:
            return
        with self._lock:
            (self._watching.add if watch else self._watching.discard)(id(offload))
            self._sync_output_hook()

    def backward_fetched(self, offload, module) -> bool:
        """Steps 2 and 3 of the NOTE: ``module``'s backward fetch fired; its backward release is
        due. Returns True where the fetch itself is deferred to the coming recompute."""
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1 or (graph_task not in self._tasks and offload not in self._checkpointing
                                and id(offload) not in self._forward_checkpointed):
            return False  # no checkpoint ran in this engine: stock's path (NOTE, last paragraph)
        self._unveil(graph_task)
        with self._lock:
            task = self._books(graph_task)
            task.due[id(module)] = (offload, module)
            coordinator = self._targets.coordinator_of(offload, module)
            task.coordinators.add(id(coordinator))
            self._coordinators_with_books.add(coordinator)
            return self._defer(offload, module)

    def _defer(self, offload, module) -> bool:
        """Step 2's deferred fetch; call with the lock held."""
        if (not self.defers_fetches or not self._recompute_pending.get(module, False)
                or getattr(offload, "zenflow", False)):
            return False
        params = list(self._targets.iter_params(module, recurse=self._targets.is_leaf_module(module)))
        if not params or any(param.requires_grad or getattr(param, "is_external_param", False)
                             or getattr(param, "ds_persist", False) or swapped_to_nvme(param) for param in params):
            return False
        # Whatever the params' status: deepspeed records each fetch in its module trace, and a
        # step that fetched where the recording step deferred would invalidate that trace.
        self._recompute_pending[module] = False
        return True

    def _count_backward_call(self, module) -> None:
        with self._lock:
            self._backward_calls_due[module] = self._backward_calls_due.get(module, 0) + 1

    def drop(self, module) -> None:
        """Step 2 of the NOTE: called right before ``module``'s backward release."""
        with self._lock:
            due = self._backward_calls_due.get(module, 0)
            if due:
                self._backward_calls_due[module] = due - 1
        if not self._by_module and not self._tasks:
            return
        with self._lock:
            holds = self._by_module.pop(id(module), None)
            task = self._tasks.get(torch._C._current_graph_task_id())
            if task is not None:
                task.due.pop(id(module), None)
        if holds is not None:
            for param in holds.params:
                param.ds_active_sub_modules.discard(holds.token)

    def release_leftovers_below(self, offload, module) -> None:
        """Step 2 of the NOTE, right before ``module``'s backward release: the descendants of
        ``module`` that will never see a backward release of their own get it now, while
        ``module`` is still in deepspeed's active-backward record (0.19.3 on), which a backward
        release asserts non-empty (a deferred fetch records nothing)."""
        if not self._by_module and not self._tasks:
            return
        graph_task = torch._C._current_graph_task_id()
        self._unveil(graph_task)
        with self._lock:
            task = self._tasks.get(graph_task)
            task_due = task.due if task is not None else {}
            if not self._by_module and not task_due:
                return
            parents = self._parent_map(offload, tuple(key for key, (owner, _) in task_due.items() if owner is offload))
            due = [entry for key, entry in task_due.items()
                   if _no_release_coming(entry[1]) and _descends(key, module, parents)]
            orphans = []
            for key, holds in list(self._by_module.items()):
                child = holds.module()
                if (child is not None and graph_task in holds.graph_tasks and _no_release_coming(child)
                        and _descends(key, module, parents) and key not in task_due):
                    orphans.append(self._by_module.pop(key))
        self._release_late(due)
        self._release_all(orphans)

    def _parent_map(self, offload, keys: Tuple[int, ...] = ()) -> Dict[int, int]:
        """id(child) -> id(parent) in ``offload``'s model, built again when one of ``keys`` (ids
        of its modules that fetched for backward) is not in it: a module added after the map."""
        root = offload.module
        parents = self._parents.get(root)
        if parents is None or any(key not in parents and key != id(root) for key in keys):
            parents = {id(child): id(parent) for parent in root.modules() for child in parent.children()}
            self._parents[root] = parents
        return parents

    def sweep(self, graph_task: int) -> None:
        """Steps 3 and 4 of the NOTE: what ``graph_task`` left behind, released when it ends."""
        with self._lock:
            closed = self._close(graph_task)
            if not closed:
                return  # swept already: by its callback, or before its coordinator's reset_step
            due, placeholders = list(closed[0].due.values()), closed[0].placeholders
        # Last fetched first, as a backward releases: ancestors stay in deepspeed's active-backward
        # record while their descendants are released (step 2).
        self._release_late(due[::-1])
        with self._lock:
            leftovers = []
            for key, holds in list(self._by_module.items()):
                if graph_task in holds.graph_tasks:
                    holds.graph_tasks.discard(graph_task)
                    if not holds.graph_tasks:
                        leftovers.append(self._by_module.pop(key))
        self._release_all(leftovers)
        _restore(placeholders)

    def switch_policy(self, policy: Policy) -> None:
        """Drop every hold and placeholder of the old policy, then put ``policy`` in force, under
        the lock: a release on another thread sees one policy or the other, never a mix."""
        with self._lock:
            if self.policy is policy:
                return
            self.release_everything()
            self.policy = policy
            self._sync_output_hook()

    def retire(self) -> None:
        """revert(): release everything; from now on the wrappers are deepspeed's methods."""
        with self._lock:
            self.retired = True
            self.release_everything()
            self._sync_output_hook()

    def release_everything(self) -> None:
        """Drop and release every hold, restore every placeholder, e.g. on revert()."""
        with self._lock:
            closed = self._close(None)
            leftovers = list(self._by_module.values())
            self._by_module.clear()
            placeholders = [entry for task in closed for entry in task.placeholders]
            self._recompute_pending.clear()
        self._release_all(leftovers)
        _restore(placeholders)

    def _release_late(self, due: List[Tuple[object, torch.nn.Module]]) -> None:
        """Stock's backward release, for modules whose own never fired."""
        if not due:
            return
        backward_release = self._targets.originals["post_sub_module_backward_function"]
        for offload, module in due:
            release = self.kept_storage.before_release(offload, module)
            self.drop(module)
            backward_release(offload, module)
            self.kept_storage.after_release(release)

    def _release_all(self, leftovers: List[_Holds]) -> None:
        released = []
        with torch.no_grad():
            for holds in leftovers:
                for param in holds.params:
                    param.ds_active_sub_modules.discard(holds.token)
                    if not getattr(param, "ds_persist", False):
                        self._targets.release_param(holds.coordinator, param)
                        released.append(param)
        self.kept_storage.after_params_released(released)


class _GraphTask:
    """What one backward graph task put on the books (steps 3 and 4): the modules whose backward
    release is due, the placeholders left, the coordinators it touched (by id), and the
    finalizer that queues its sweep if torch frees it without running its callback."""

    __slots__ = ("due", "placeholders", "coordinators", "finalizer")

    def __init__(self):
        # id(module) -> (offload, module), fetched for backward, not yet released.
        self.due: Dict[int, Tuple[object, torch.nn.Module]] = {}
        self.placeholders: List[_Placeholder] = []
        self.coordinators: Set[int] = set()
        self.finalizer: Optional[weakref.finalize] = None


class _GraphTaskEnd:
    """Held only by the callback queued on a graph task (step 4). torch drops the callback with
    the graph task, so a finalizer on this object runs once that graph task is gone, on whatever
    thread frees it; it only queues the task's id."""

    __slots__ = ("__weakref__", )


def _no_release_coming(module: torch.nn.Module) -> bool:
    """No backward release is pending: ZeRO counts a module's inputs that need grad
    (ds_grads_remaining) and releases when the last one's grad arrives; keyword-only calls
    and no-grad inputs count none."""
    return getattr(module, "ds_grads_remaining", 0) <= 0


def _descends(key: int, ancestor: torch.nn.Module, parents: Dict[int, int]) -> bool:
    """Whether the module with id ``key`` sits below ``ancestor``; unknown ids do not."""
    parent = parents.get(key)
    while parent is not None:
        if parent == id(ancestor):
            return True
        parent = parents.get(parent)
    return False


def _restore(placeholders: List[_Placeholder]) -> None:
    """Put stock's partitioned tensor back where a placeholder is still in place."""
    for entry in placeholders:
        if _same_tensor(entry.param.data, entry.placeholder):
            entry.param.data = entry.partitioned
