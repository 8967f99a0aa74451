"""The forward watch: a module forward hook on each module of a model the rules read, armed per model.

NOTE [ Forward watch ]

1. Inside a backward graph task it notes on the module, with the graph task, whether the call's
   output needs grad (NOTE [ Notes on the module ]): the lifecycle's exemption (lifecycle NOTE,
   rule 1) reads it at the release that follows, on the same thread; unknown, or noted in another
   graph task, counts as needed while grad is enabled (a call without grad builds no graph: a
   reference model's forward inside a backward).
2. Outside any backward, in a grad-enabled call inside a checkpoint whose recompute reruns module
   calls, it walks the graph the call built (NOTE [ Params read outside saved tensors ]) for the
   deferral (NOTE [ Deferred fetch ]) and for kept storage (NOTE [ Gathered storage kept outside
   saved tensors ]). For kept storage alone a module's NONE is kept per class of its output's
   grad_fn and reused: wrong, it costs stock's memory, never a result; FOUND is walked every call.
   The deferral's calls are each walked, as a wrong NONE there skips a fetch a backward needs.
3. It sits on each module of an engine's model with a frozen param of its own (the rules read
   nothing of any other), put first among the module's forward hooks so that it runs before
   deepspeed's release. It is armed in the engine's first grad-enabled forward that runs a module
   a checkpoint may recompute, at that module's release (its root's, for a reentrant checkpoint),
   or at every grad-enabled root fetch while the deferral is in force (which walks from the first
   call); and armed again at a grad-enabled root fetch where a param's requires_grad changed
   since. A model no checkpoint runs in carries none outside the deferral, nor any forward
   without grad (a reference model's). Each module carries it once, and a hook not on the books
   (a model's deepcopy, or after revert(), which takes every one off) records nothing.
"""
import operator
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Set

import torch

from zero3_recompute.autograd_reads import (FOUND, NONE, function_class_reader, output_grad_fn, output_needs_grad,
                                            walk_module_call)
from zero3_recompute.by_id import ById
from zero3_recompute.targets import CHECKPOINT_PACK_HOOKS, Targets, named_in, own_params

_requires_grad = operator.attrgetter("requires_grad")


@dataclass
class _Armed:
    """What a model's hooks were put on for: each module's own params then, in the model's order,
    weakly (a ZeRO-3 param reaches its optimizer, and so its engine), and their requires_grad."""
    params: list
    requires_grad: Optional[bytes]


class ModuleHooks:
    """Rule 3: the watch's hook on each module with a frozen param of its own of an armed model.
    Not on every module call (torch's global hook): a module the rules read nothing of costs
    nothing. By module, once whatever models it is in; a hook on a module not on the books (a
    copy.deepcopy of a model copies the function as it is, as deepspeed's own hooks) records
    nothing, nor any once revert() took them off."""

    def __init__(self, is_leaf_module: Callable, watch: "ForwardWatch"):
        self._is_leaf_module = is_leaf_module
        self._armed = ById()  # id(root) -> _Armed
        self._hooked = hooked = ById()  # id(module) -> its hook's handle

        def hook(module, args, *rest):  # (kwargs, output); (output) where torch raced a removal
            if id(module) in hooked and len(rest) == 2:
                watch._record(module, args, *rest)  # read when called: a bench may time it

        self.hook = hook  # the function each module carries

    def arm(self, root, check: bool) -> None:
        """The hooks on ``root``'s modules, put on where none are; ``check``: where a param's
        requires_grad changed since, put on and taken off again (on the training thread, outside
        any backward)."""
        armed = self._armed.get(id(root))
        if armed is not None and (not check or _requires_grad_of(armed.params) == armed.requires_grad):
            return
        if not isinstance(root, torch.nn.Module):
            return
        params = []
        for module in root.modules():
            own = [param for param in own_params(module, self._is_leaf_module) if param is not None]
            params.extend(map(weakref.proxy, own))
            handle = self._hooked.get(id(module))
            if not all(map(_requires_grad, own)):
                if handle is None:
                    self._hooked.put(module, module.register_forward_hook(self.hook, prepend=True, with_kwargs=True))
            elif handle is not None:
                handle.remove()
                del self._hooked[id(module)]
        self._armed.put(root, _Armed(params, _requires_grad_of(params)))

    def disarm(self) -> None:
        """Every hook off (revert())."""
        handles = list(self._hooked.values())
        self._hooked.clear()
        self._armed = ById()
        for handle in handles:
            handle.remove()


def _requires_grad_of(params: list) -> Optional[bytes]:
    """Each param's requires_grad, in C calls; None where one was collected."""
    try:
        return bytes(map(_requires_grad, params))
    except ReferenceError:
        return None


class ForwardWatch:
    """The hook, the outputs it noted (rule 1), and the engines whose training forward under way
    it watches for kept storage (rule 2)."""

    def __init__(self, targets: Targets, deferral, kept_storage, output_key: str):
        self._targets = targets
        self._function_class = function_class_reader(*targets.python_function_node)
        self._deferral = deferral
        self._kept = kept_storage
        self._kept_enabled = kept_storage.enabled  # fixed when the layer is built
        self._output_key = output_key  # NoteKeys.output: the module's note of rule 1
        self.hooks = ModuleHooks(targets.is_leaf_module, self)
        self._watched: Set[int] = set()
        # id(module) -> {id(cls): weakref.ref(cls)} of the classes of its outputs' grad_fn its walks
        # found NONE for (rule 2, kept storage alone). Weakly: deepspeed makes a Function class per
        # module whose methods reach the module and its engine, which a class held here would keep
        # alive; a hit is that class itself, not another at the address of a collected one.
        self._walked = ById()
        # Set by the ledger: whether the deferral is in force (rule 2).
        self.defers = False

    def training_forward(self, offload, checkpointing: bool) -> None:
        """A grad-enabled root fetch of ``offload``: its model's hooks armed and checked where it
        checkpoints or the deferral is in force (rule 3), and its forward watched where it checkpoints."""
        if checkpointing or self.defers:
            self.hooks.arm(offload.module, check=True)
        if checkpointing:
            self.watch(offload, True)

    def watch(self, offload, watched: bool) -> None:
        """Starts or ends the watch of ``offload``'s training forward (kept storage on)."""
        if self._kept_enabled:
            (self._watched.add if watched else self._watched.discard)(id(offload))

    def watching(self, offload) -> bool:
        """Whether ``offload``'s training forward under way is watched, or can never be (kept
        storage off): either way no later release of that forward starts the watch."""
        return not self._kept_enabled or id(offload) in self._watched

    def forward_released(self, offload, module, grad_enabled: bool, pack, defers: bool) -> None:
        """A forward release outside any backward, ``pack`` the saved-tensors pack hook in force: the
        deferral's note, and the watch of the engine's training forward started (inside a
        rerunning checkpoint) or ended (its root)."""
        if defers and grad_enabled:
            self._deferral.forward_done(module, pack is not None and named_in(pack, CHECKPOINT_PACK_HOOKS))
        if module is offload.module:
            self._kept.forward_ended()
            self.watch(offload, False)
        # Once the forward is watched, nothing here reads the hook again.
        elif (grad_enabled and pack is not None and id(offload) not in self._watched
              and named_in(pack, CHECKPOINT_PACK_HOOKS)):
            self.watch(offload, True)

    def _record(self, module, args, kwargs, output) -> None:
        graph_task = torch._C._current_graph_task_id()
        if graph_task == -1:
            if not self.defers and not self._watched:
                return
            if not self._kept.engaged and not self.defers and self._known_none(module, output):
                return  # what the walk would find is known, and nothing but a FOUND reads it
            self._walk(module, args, kwargs, output)
            return
        module.__dict__[self._output_key] = (graph_task, output.requires_grad if type(output) is torch.Tensor
                                             else output_needs_grad(output))

    def _walk(self, module, args, kwargs, output) -> None:
        """Rule 2, one walk for both layers, over a call's positional arguments and then its keyword
        arguments' values; the call of a module without a frozen param of deepspeed's reads nothing
        more. The caller passes over a call whose walk is known."""
        # A module's own params, as ModuleHooks read them; only deepspeed's (with a ds_id) count.
        frozen = total = 0
        for param in own_params(module, self._targets.is_leaf_module):
            if param is not None:
                total += 1
                if not param.requires_grad and hasattr(param, "ds_id"):
                    frozen += 1
        found: Optional[str] = None
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
        """Rule 1: noted for this call of ``module`` in ``graph_task``, the one under way; taken once.
        Not noted in it (a module without the hook): needed while grad is enabled."""
        noted = module.__dict__.pop(self._output_key, None)
        return torch.is_grad_enabled() if noted is None or noted[0] != graph_task else noted[1]
