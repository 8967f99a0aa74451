"""The innermost saved-tensors pack hook in force, on torch releases that cannot say.

NOTE [ Reading the saved-tensors hook stack ]

A layer over the core (layer name ``hook_stack``), needed on torch < 2.8 alone.
1. torch keeps the saved-tensors default hooks (``saved_tensors_hooks`` and all built on it: both
   non-reentrant checkpoints, save_on_cpu) on a per-thread C++ stack, which torch 2.8 on reads
   itself (``_top_saved_tensors_default_hooks``): there the layer is not installed.
2. Before 2.8, ``ShadowStack`` replaces the two bindings every Python push and pop goes through,
   calls the original first, then pushes or pops the pack hook on a per-thread stack of its own,
   so its top is C++'s top.
3. Each entry records where it was pushed (``Where``: graph task and node, or outside backward),
   since the engine restores a node's thread state when the node ends and so drops a push the
   node never popped.
4. ``settle()`` drops what C++ no longer has: outside backward, every entry pushed inside one;
   inside a node, those of another node of the same graph task (``in_force``).
5. Switched off, a hook reads as in force everywhere but as no checkpoint's
   (targets.UNKNOWN_PACK_HOOK): the core then holds under the reentrant checkpoint too, as
   ``keep`` does, keeps books for every training backward, and neither the deferral nor kept
   storage sees a forward under a checkpoint.

The details. A push inside a node that the node never pops is a checkpoint's forward left
suspended by an exception, closed only when its generator is collected. An entry of another
graph task stays under rule 4 (it may be the node that started this nested backward): taken for
in force, a hook only makes the core hold. Reading the top settles first, and the core settles at
every forward release outside backward, so an entry of a backward that ended is gone before the
next one starts; dropped, it is also not what a late pop takes off (that pops C++'s top, and ours).
``saved_tensors_hooks.__enter__`` and ``__exit__`` look the bindings up on the module at each call,
which targets fingerprints. What the shadow cannot see, and why that is safe here:
- hooks pushed before it was installed: a pop with its own stack empty changes nothing, so a
  context entered earlier is simply not seen (LIFO keeps every later one right);
- the stack a graph task copies from the thread that called backward onto an autograd device
  thread. The recompute of both non-reentrant checkpoints pushes its own hook on the thread
  that runs it, inside the unpack hook, so what the core asks during a recompute is always
  answered on that thread.
The bindings and what ``where`` reads are given by targets (ShadowBindings), the only door to
torch's private API.
"""
import threading
from typing import Callable, Hashable, Optional, Tuple, Union

from zero3_recompute.targets import POP_HOOKS, PUSH_HOOKS, SHADOW_READER, SavedTensorsProbe, ShadowBindings

LAYER = "hook_stack"

# Where a push happened: (graph task id, node key); (OUTSIDE_BACKWARD, None) outside any backward.
Where = Tuple[int, Hashable]
OUTSIDE_BACKWARD = -1


def in_force(pushed: Where, here: Where) -> bool:
    """Whether C++ still holds an entry pushed at ``pushed`` when read at ``here`` (NOTE above)."""
    pushed_task, pushed_node = pushed
    here_task, here_node = here
    if pushed_task == OUTSIDE_BACKWARD:
        return True
    if here_task == OUTSIDE_BACKWARD:
        return False
    return pushed_task != here_task or pushed_node == here_node


def where_reader(bindings: ShadowBindings) -> Callable[[], Where]:
    """Where this thread is in autograd (rule 3): (graph task, the running node's key), or
    (OUTSIDE_BACKWARD, None)."""
    current_graph_task, current_node, node_key = bindings.current_graph_task, bindings.current_node, bindings.node_key

    def where() -> Where:
        task = current_graph_task()
        if task == OUTSIDE_BACKWARD:
            return OUTSIDE_BACKWARD, None
        node = current_node()
        return task, None if node is None else node_key(node)

    return where


class ShadowStack:
    """Pack hooks pushed through the wrapped bindings, per thread; see NOTE above."""

    def __init__(self, bindings: ShadowBindings):
        self.original_push = bindings.push
        self.original_pop = bindings.pop
        self._where = where_reader(bindings)
        self._local = threading.local()
        shadow = self

        def _push_saved_tensors_default_hooks(pack_hook, unpack_hook):
            result = shadow.original_push(pack_hook, unpack_hook)
            shadow._stack().append((pack_hook, shadow._where()))
            return result

        def _pop_saved_tensors_default_hooks():
            result = shadow.original_pop()
            stack = shadow._stack()
            if stack:
                stack.pop()
            return result

        _push_saved_tensors_default_hooks.__zero3_recompute_shadow__ = self
        _pop_saved_tensors_default_hooks.__zero3_recompute_shadow__ = self
        self.push = _push_saved_tensors_default_hooks
        self.pop = _pop_saved_tensors_default_hooks

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def settle(self) -> None:
        """Drop this thread's entries that the engine has already taken off C++'s stack."""
        stack = getattr(self._local, "stack", None)
        if stack:
            here = self._where()
            stack[:] = [entry for entry in stack if in_force(entry[1], here)]

    def top_pack_hook(self) -> Optional[Callable]:
        """The innermost pack hook in force that this thread pushed since installation, or None."""
        self.settle()
        stack = getattr(self._local, "stack", None)
        return stack[-1][0] if stack else None


def shadow_of(binding) -> Optional[ShadowStack]:
    """The ShadowStack a binding belongs to, if it is one of ours."""
    return getattr(binding, "__zero3_recompute_shadow__", None)


def reader(found: Union[SavedTensorsProbe, ShadowBindings]) -> SavedTensorsProbe:
    """What the core reads the hook in force with: torch's own reader (or none, switched off) as
    targets found it; over ShadowBindings, a shadow stack and the two installs that put it in
    place, or, where ours is still installed (left under someone who wrapped it after revert()),
    that one, installing nothing."""
    if isinstance(found, SavedTensorsProbe):
        return found
    installed = shadow_of(found.push)
    if installed is not None and shadow_of(found.pop) is installed:
        return SavedTensorsProbe(SHADOW_READER, installed.top_pack_hook, settle=installed.settle)
    shadow = ShadowStack(found)
    return SavedTensorsProbe(SHADOW_READER, shadow.top_pack_hook,
                             ((found.owner, PUSH_HOOKS, found.push, shadow.push),
                              (found.owner, POP_HOOKS, found.pop, shadow.pop)), shadow.settle)
