"""An engine's forward fetches past the package's wrapper, all but its root's.

NOTE [ Forward fetch at the root alone ]

A layer over the lifecycle's core (layer name ``root_fetch``), for host time alone: it changes
no gather, release or hold.
1. Of an engine's forward fetches the core reads its root's alone (the ledger's forward_fetching),
   and kept storage, once engaged, every one; yet the wrapper on the class costs every fetch a
   Python frame (450 a step at 64 blocks: docs/performance.md, issue #37's twelfth round).
2. At the engine's root fetch through the wrapper, deepspeed's method, bound to the engine's
   DeepSpeedZeRoOffload, goes into that object's __dict__ (which Python reads before the class),
   and a forward pre-hook of ours, put first on the root, does the root's part from then on.
3. That hook does it only while the engine is as the bypass found it: deepspeed's fetch hook for
   the engine still on the root (looked for again where its key is gone: TRL's unwrap for
   generation takes deepspeed's hooks off and registers them anew), the bound method still in the
   __dict__, and the wrapper still what the engine's class resolves. Otherwise it takes the bypass
   off, and deepspeed's hook, which runs after ours, reaches the wrapper for that very fetch.
4. Kept storage's first storage taken in (its refill reads every fetch) and revert() take every
   bypass off, each removing only what is still its own; after either, none is put on again.
5. A compiled root (Module.compile, deepspeed's engine.compile) gets no bypass, and loses one it had:
   the compiled call path stays as deepspeed's hooks and the wrapper make it.
6. An engine's entry, and its hook on the root, go when the engine is collected (deepspeed's model
   holds its engine, through the Function classes its hooks put on each module: a destroyed
   engine's bypass comes off at its root's next forward, by rule 3, or at revert()).
Threads: a bypass is put on and checked on the training thread, at a root fetch; revert() may take
them off from another, under the layer's lock, and a fetch under way then still passes deepspeed's
method as it found it.
"""
import threading
import types
import weakref
from typing import Any, Callable, Dict, Optional

import torch

from zero3_recompute.targets import Targets, compiled, fetch_hook_key, has_forward_pre_hook

LAYER = "root_fetch"
FETCH = "pre_sub_module_forward_function"  # deepspeed's method, read as self.<FETCH> by its hook


class _Bypass:
    """One engine's bypass (rule 2): what was put on, to check and take off."""

    __slots__ = ("offload", "root", "handle", "fetch_hook")

    def __init__(self, offload, fetch_hook: int):
        # Weakly: the ledger outlives every engine. The bound method in the engine's __dict__ is
        # told by what it binds, never held here: it holds its engine.
        self.offload = weakref.ref(offload)
        self.root = weakref.ref(offload.module)
        self.fetch_hook = fetch_hook  # the key of deepspeed's fetch hook on the root
        self.handle = None  # ours on the root


class RootFetch:
    """The bypasses of one ledger, by engine (NOTE)."""

    def __init__(self, targets: Targets, wrapper: Callable, root_part: Callable[[Any, Any], None]):
        self._original = targets.originals[FETCH]
        self._wrapper = wrapper  # the wrapper the class carries
        self._root_part = root_part  # the ledger's forward_fetching
        # id(offload) -> its _Bypass, None while off: an engine keeps its entry, and the one finalizer
        # registered for it (rule 6), however often TRL's unwrap takes its bypass off and the wrapper puts it on.
        self._bypasses: Dict[int, Optional[_Bypass]] = {}
        self._lock = threading.RLock()  # around putting on and taking off (NOTE, threads)
        self.stopped = False  # rule 4

    def __len__(self) -> int:
        """The bypasses on."""
        return sum(bypass is not None for bypass in self._bypasses.values())

    def take_on(self, offload) -> None:
        """At ``offload``'s root fetch through the wrapper, after the root's part (rule 2)."""
        if self.stopped or self._bypasses.get(id(offload)) is not None or FETCH in vars(offload):
            return
        if getattr(type(offload), FETCH, None) is not self._wrapper:
            return  # a subclass's own method, or someone's wrapper over ours: theirs runs as it is
        root = offload.module
        fetch_hook = None if compiled(root) else fetch_hook_key(offload, root)
        if fetch_hook is None:
            return
        with self._lock:
            if self.stopped:
                return
            key = id(offload)
            if key not in self._bypasses:
                weakref.finalize(offload, self._forget, key).atexit = False
            bypass = self._bypasses[key] = _Bypass(offload, fetch_hook)
            bypass.handle = root.register_forward_pre_hook(self._hook(bypass), prepend=True)
            vars(offload)[FETCH] = types.MethodType(self._original, offload)

    def _forget(self, key: int) -> None:
        """Rule 6: ``key``'s engine collected."""
        with self._lock:
            bypass = self._bypasses.pop(key, None)
        if bypass is not None:
            bypass.handle.remove()

    def _bound_in_place(self, offload) -> bool:
        """Whether ``offload``'s __dict__ still holds deepspeed's method bound to it (rule 3)."""
        found = vars(offload).get(FETCH)
        return getattr(found, "__func__", None) is self._original and found.__self__ is offload

    def _hook(self, bypass: _Bypass) -> Callable:
        in_force = self._in_force

        def root_fetch(module, args):
            offload = bypass.offload()
            if offload is not None and module is bypass.root() and in_force(bypass, offload, module):
                self._root_part(offload, module)

        # Never traced (rule 5 keeps a bypass off a compiled root; a model compiled otherwise breaks
        # its graph here, as at deepspeed's own hooks from 0.16 on, which torch.compiler.disable too).
        return torch.compiler.disable(root_fetch)

    def _in_force(self, bypass: _Bypass, offload, root) -> bool:
        """Rule 3, at each forward's root."""
        if not has_forward_pre_hook(root, bypass.fetch_hook):
            found = fetch_hook_key(offload, root)
            if found is None:
                self._take_off(offload, bypass)  # deepspeed's hooks are off: nothing fetches
                return False
            bypass.fetch_hook = found
        if (not self.stopped and self._bound_in_place(offload) and getattr(type(offload), FETCH, None) is self._wrapper
                and not compiled(root)):
            return True
        self._take_off(offload, bypass)
        return False

    def _take_off(self, offload: Optional[Any], bypass: _Bypass) -> None:
        with self._lock:
            if offload is not None and self._bypasses.get(id(offload)) is bypass:
                self._bypasses[id(offload)] = None
            bypass.handle.remove()
            if offload is not None and self._bound_in_place(offload):
                del vars(offload)[FETCH]

    def stop(self) -> None:
        """Every bypass off, and none put on again (rule 4)."""
        with self._lock:
            self.stopped = True
            for bypass in list(self._bypasses.values()):
                if bypass is not None:
                    self._take_off(bypass.offload(), bypass)
