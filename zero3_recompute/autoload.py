"""Activate the patch when deepspeed is imported, with no change to the training script.

``zero3_recompute.pth`` (installed into site-packages) runs ``install()`` at interpreter
start-up unless the opt-out variable is set. That runs in every Python process of the
environment, so until deepspeed's module is actually being imported it costs one meta-path
entry and imports nothing beyond ``os`` and ``sys``, which every interpreter has loaded by
then. The finder and loader below are duck-typed, as the import system asks no more (no
``importlib.abc``); ``importlib.util`` and ``logging`` are imported when the target module is
found. ``install()`` patches at once if that module is already loaded. The hook calls
``patch.apply(auto=True)``, which logs one line and changes nothing when deepspeed is
unsupported or has changed.
"""
import _thread
import os
import sys

ENV_DISABLE = "ZERO3_RECOMPUTE_DISABLE"
TRIGGER_MODULE = "deepspeed.runtime.zero.parameter_offload"
_TRUE = ("1", "true", "yes", "on")


def disabled() -> bool:
    return os.environ.get(ENV_DISABLE, "").strip().lower() in _TRUE


def _activate(_module=None) -> None:
    try:
        from zero3_recompute import patch

        patch.apply(auto=True)
    except Exception as exc:  # auto mode must never break the user's import of deepspeed
        import logging

        logging.getLogger("zero3_recompute").warning("zero3_recompute: not activated: %s: %s",
                                                     type(exc).__name__, exc)


class _CallbackLoader:
    """Runs the real loader, then the callback; afterwards the module keeps its real loader."""

    def __init__(self, loader, callback):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader
        self._callback(module)


class PostImportFinder:
    """A meta-path finder that finds nothing itself: for one module name, it wraps the real
    spec's loader. Its own look-up re-enters it; the guard is per thread (``_thread``, built
    in), so a look-up on one thread never hides the module from an import on another."""

    def __init__(self, fullname: str, callback):
        self.fullname = fullname
        self.callback = callback
        self._busy = set()

    def find_spec(self, fullname, path, target=None):
        thread = _thread.get_ident()
        if fullname != self.fullname or thread in self._busy:
            return None
        import importlib.util

        self._busy.add(thread)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(thread)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _CallbackLoader(spec.loader, self.callback)
        return spec


def _installed_finder():
    return next((finder for finder in sys.meta_path if isinstance(finder, PostImportFinder)
                 and finder.fullname == TRIGGER_MODULE), None)


def install() -> None:
    """Arm auto-activation (what the .pth line calls). Honours the opt-out; idempotent."""
    if disabled():
        return
    if TRIGGER_MODULE in sys.modules:
        _activate()
        return
    if _installed_finder() is None:
        sys.meta_path.insert(0, PostImportFinder(TRIGGER_MODULE, _activate))
