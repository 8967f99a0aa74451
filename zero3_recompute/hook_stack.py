"""The innermost saved-tensors pack hook in force, on torch releases that cannot say.

NOTE [ Reading the saved-tensors hook stack ]

torch keeps the saved-tensors default hooks (``torch.autograd.graph.saved_tensors_hooks`` and
everything built on it: torch's non-reentrant checkpoint, deepspeed's non_reentrant_checkpoint,
save_on_cpu) on a per-thread stack in C++. From torch 2.8 on,
``torch._C._autograd._top_saved_tensors_default_hooks`` reads its top. Before that nothing
reads it, but every Python push and pop goes through two bindings,
``torch._C._autograd._push_saved_tensors_default_hooks`` and ``..._pop_...``, which
``saved_tensors_hooks.__enter__`` and ``__exit__`` look up on the module at each call
(targets fingerprints that). ``ShadowStack`` stands in for both bindings: it calls the
original, and only once that returned, pushes or pops the pack hook on a stack of its own for
the calling thread, so both stacks move in lockstep and its top is the C++ stack's top.

The autograd engine also moves the C++ stack on its own: it runs each backward node under the
thread-local state the graph task captured, and restores the thread's state when the node
ends. A push inside a node that the node never pops (a checkpoint's forward left suspended by
an exception, closed only when its generator is collected) is so gone from C++ when the node
ends. So each entry records where it was pushed (``where``: the graph task and the node, or
outside any backward), and ``settle()`` drops the entries C++ no longer has: outside any
backward, every entry pushed inside one; inside a node, entries pushed in another node of the
same graph task. An entry of another graph task stays (it may be the node that started this
nested backward): taken for in force, a hook only makes the ledger hold. Reading the top
settles first, and the ledger settles at every forward release outside backward, so an entry
of a backward that ended is gone before the next one starts. Dropped, it is also not what a
late pop (the suspended forward collected at last) takes off: that pops C++'s top, and ours.

What it cannot see, and why that is safe here:
- hooks pushed before it was installed: a pop with its own stack empty changes nothing, so a
  context entered earlier is simply not seen (LIFO keeps every later one right);
- the stack a graph task copies from the thread that called backward onto an autograd device
  thread. The recompute of both non-reentrant checkpoints pushes its own hook on the thread
  that runs it, inside the unpack hook, so what the ledger asks during a recompute is always
  answered on that thread.
Standard library only; the bindings and ``where`` are given by targets, the only door to
torch's private API.
"""
import threading
from typing import Callable, Hashable, Optional, Tuple

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


class ShadowStack:
    """Pack hooks pushed through the wrapped bindings, per thread; see NOTE above."""

    def __init__(self, push: Callable, pop: Callable, where: Callable[[], Where]):
        self.original_push = push
        self.original_pop = pop
        self._where = where
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
