"""The one global module forward hook, registered only while something needs it.

NOTE [ Forward watch ]

1. Inside a backward graph task it notes, per thread and graph task, whether each module call's
   output needs grad: the lifecycle's exemption (lifecycle NOTE, rule 1) reads it at the release
   that follows; unknown counts as needed.
2. Outside any backward, in a grad-enabled call inside a checkpoint whose recompute reruns module
   calls, it walks the graph the call built (NOTE [ Params read outside saved tensors ]) for the
   deferral (NOTE [ Deferred fetch ]) and for kept storage (NOTE [ Gathered storage kept outside
   saved tensors ]). For kept storage alone a module's NONE is kept per class of its output's
   grad_fn and reused: wrong, it costs stock's memory, never a result; FOUND is walked every call.
   The deferral's calls are each walked, as a wrong NONE there skips a fetch a backward needs.
   A module whose own params are its table (not a leaf deepspeed treats as one, with children)
   and were none frozen at a call is known as such, and its later calls are passed over while
   every param on its table still requires grad, a test in C calls alone: a param frozen or
   registered since is seen at once.
3. It is registered while a graph task has books, while the deferral is in force, or while an
   engine's training forward is watched for kept storage: a model no checkpoint runs in never
   sees it.
"""
import operator
import threading
import weakref
from typing import Optional, Set

import torch

from zero3_recompute.autograd_reads import (FOUND, NONE, function_class_reader, output_grad_fn, output_needs_grad,
                                            walk_module_call)
from zero3_recompute.by_id import ById
from zero3_recompute.targets import (CHECKPOINT_PACK_HOOKS, Targets, has_children, is_a_param, named_in, own_params,
                                     param_table)

_requires_grad = operator.attrgetter("requires_grad")


class ForwardWatch:
    """The hook, the outputs it noted (rule 1), and the engines whose training forward under way
    it watches for kept storage (rule 2)."""

    def __init__(self, targets: Targets, deferral, kept_storage):
        self._targets = targets
        self._function_class = function_class_reader(*targets.python_function_node)
        self._deferral = deferral
        self._kept = kept_storage
        self._kept_enabled = kept_storage.enabled  # fixed when the layer is built
        self._outputs = threading.local()
        self._hook = None
        self._watched: Set[int] = set()
        # id(module) -> {id(cls): weakref.ref(cls)} of the classes of its outputs' grad_fn its walks
        # found NONE for (rule 2, kept storage alone). Weakly: deepspeed makes a Function class per
        # module whose methods reach the module and its engine, which a class held here would keep
        # alive; a hit is that class itself, not another at the address of a collected one.
        self._walked = ById()
        # The ids of the modules whose own params are their table and were none frozen (whatever
        # their ds_id: a model called before deepspeed.initialize has none yet) at a walk (rule 2).
        self._table_unfrozen = ById()
        # Set by the ledger: whether the deferral is in force (rule 2).
        self.defers = False

    def sync(self, books_open: bool, retired: bool) -> None:
        """Rule 3; call with the ledger's lock held."""
        wanted = not retired and (books_open or self.defers or bool(self._watched))
        if wanted and self._hook is None:
            self._hook = self._register()
        elif not wanted and self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _register(self):
        """The hook, seeing a call's inputs as its positional arguments, then its keyword
        arguments' values where torch passes them (the walk stops at every input)."""
        register = self._targets.register_forward_hook
        if self._targets.forward_hook_takes_kwargs:
            return register(self._record, with_kwargs=True)
        record = self._record
        return register(lambda module, args, output: record(module, args, None, output))

    def watch(self, offload, watched: bool) -> bool:
        """Starts or ends the watch of ``offload``'s training forward; True when that changed
        (the caller then syncs the hook)."""
        if not self._kept_enabled or (id(offload) in self._watched) == watched:
            return False
        (self._watched.add if watched else self._watched.discard)(id(offload))
        return True

    def watching(self, offload) -> bool:
        """Whether ``offload``'s training forward under way is watched, or can never be (kept
        storage off): either way no later release of that forward starts the watch."""
        return not self._kept_enabled or id(offload) in self._watched

    def forward_released(self, offload, module, grad_enabled: bool, pack, defers: bool) -> bool:
        """A forward release outside any backward, ``pack`` the saved-tensors pack hook in force: the
        deferral's note, and the watch of the engine's training forward started (inside a
        rerunning checkpoint) or ended (its root); True when the hook must be synced."""
        if defers and grad_enabled:
            self._deferral.forward_done(module, pack is not None and named_in(pack, CHECKPOINT_PACK_HOOKS))
        if module is offload.module:
            self._kept.forward_ended()
            return self.watch(offload, False)
        # Once the forward is watched, nothing here reads the hook again.
        return (grad_enabled and pack is not None and id(offload) not in self._watched
                and named_in(pack, CHECKPOINT_PACK_HOOKS) and self.watch(offload, True))

    def _record(self, module, args, kwargs, output) -> None:
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1:
            if not self.defers and not self._watched:
                return
            if not self._kept.engaged:  # what the walk would find is known, and nothing but a FOUND reads it
                if id(module) in self._table_unfrozen and all(map(_requires_grad, filter(
                        is_a_param, param_table(module).values()))):
                    return
                if not self.defers and self._known_none(module, output):
                    return
            self._walk(module, args, kwargs, output)
            return
        outputs = self._outputs
        if getattr(outputs, "graph_task", None) != graph_task:
            outputs.graph_task, outputs.needs_grad = graph_task, {}
        outputs.needs_grad[id(module)] = output.requires_grad if type(output) is torch.Tensor else output_needs_grad(
            output)

    def _walk(self, module, args, kwargs, output) -> None:
        """Rule 2, one walk for both layers, over a call's positional arguments and then its keyword
        arguments' values; the call of a module without a frozen param of deepspeed's reads nothing
        more. The caller passes over a call whose walk is known."""
        # A module's own params, not deepspeed's iter_params: the hook sees every module's call,
        # also of models deepspeed does not manage (a reference model), whose params have no ds_id.
        frozen = total = 0
        any_frozen = False
        for param in own_params(module, self._targets.is_leaf_module):
            if param is not None:
                total += 1
                if not param.requires_grad:
                    any_frozen = True
                    frozen += hasattr(param, "ds_id")
        found: Optional[str] = None
        if not any_frozen and id(module) not in self._table_unfrozen and not (
                has_children(module) and self._targets.is_leaf_module(module)):
            self._table_unfrozen.put(module, True)
        if frozen and torch.is_grad_enabled() and named_in(self._targets.saved_tensors.top_pack_hook(),
                                                           CHECKPOINT_PACK_HOOKS):
            all_frozen = frozen == total
            inputs = (*args, *kwargs.values()) if kwargs else args
            if self.defers and all_frozen:
                found = walk_module_call(inputs, output, self._function_class)
            elif self._watched:
                found = self._walk_once(module, inputs, output)
            if self.defers and all_frozen and found == NONE:
                self._deferral.note_call(module)
        if self._watched and (found == FOUND or self._kept.engaged):
            self._kept.note_call(module, output if found == FOUND else None)

    def _known_none(self, module, output) -> bool:
        """Whether a walk of ``module`` found NONE for the class of this call's output's grad_fn."""
        walked = self._walked.get(id(module))
        if walked is None:
            return False
        cls = type(output.grad_fn if type(output) is torch.Tensor else output_grad_fn(output))
        found = walked.get(id(cls))
        return found is not None and found() is cls

    def _walk_once(self, module, inputs, output) -> str:
        """Rule 2 for kept storage alone: NONE where a walk of ``module`` found it for an output's
        grad_fn of this class; any other call (no grad_fn to read, FOUND, UNKNOWN) is walked."""
        if self._known_none(module, output):
            return NONE
        found = walk_module_call(inputs, output, self._function_class)
        if found == NONE:
            self._note_none(module, output_grad_fn(output))
        return found

    def _note_none(self, module, node) -> None:
        """Rule 2: ``module``'s calls whose output's grad_fn is of ``node``'s class walk to NONE."""
        if node is not None:
            walked = self._walked.get(id(module))
            if walked is None:
                walked = self._walked.put(module, {})
            walked[id(type(node))] = weakref.ref(type(node))

    def output_needs_grad(self, module, graph_task: int) -> bool:
        """Rule 1: noted for this call of ``module`` in ``graph_task``, the one under way; taken once."""
        if getattr(self._outputs, "graph_task", None) != graph_task:
            return True
        return self._outputs.needs_grad.pop(id(module), None) is not False
