"""apply() / revert() / status(): the patch's life cycle over the installed deepspeed.

apply() checks the deepspeed version first, then resolves and fingerprints every target
(targets.resolve) before it changes anything, so a mismatch leaves deepspeed untouched. The
originals are read from ``vars(cls)`` and kept under a marker attribute on the class; that
marker makes apply() idempotent and lets revert() put back the exact original objects.
"""
import functools
import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Optional

from zero3_recompute import versions
from zero3_recompute.errors import PatchTargetMismatch, UnsupportedDeepSpeedVersion, Zero3RecomputeError

logger = logging.getLogger("zero3_recompute")

MARKER = "__zero3_recompute_originals__"
POLICY = "hold-until-owner-backward"
DISABLE_HINT = "set ZERO3_RECOMPUTE_DISABLE=1 before starting Python, or call zero3_recompute.revert()"

_lock = threading.RLock()
_ledger = None


@dataclass(frozen=True)
class PatchStatus:
    """Where the patch stands.

    mode is one of:
      'patched'      our handling is installed on deepspeed's ZeRO-3 hooks;
      'upstream'     deepspeed >= 0.19.3 handles recompute itself, nothing is patched;
      'not-applied'  a supported deepspeed that is not patched (yet, or after revert());
      'unsupported'  a deepspeed version outside the supported range, nothing is patched;
      'mismatch'     a patch target changed shape, nothing is patched;
      'no-deepspeed' deepspeed cannot be imported.
    """

    mode: str
    deepspeed_version: Optional[str]
    detail: str
    policy: Optional[str] = None

    @property
    def active(self) -> bool:
        return self.mode == "patched"

    @property
    def fixed(self) -> bool:
        """True where frozen params survive a recompute, by us or by deepspeed itself."""
        return self.mode in ("patched", "upstream")

    def __str__(self) -> str:
        policy = f", policy {self.policy}" if self.policy else ""
        return f"zero3_recompute: {self.mode} (deepspeed {self.deepspeed_version}{policy}): {self.detail}"


def deepspeed_version() -> str:
    """The installed deepspeed's version, readable while deepspeed is still importing."""
    return importlib.import_module("deepspeed.git_version_info").version


def _offload_class():
    from zero3_recompute.targets import OFFLOAD_CLASS, OFFLOAD_MODULE

    return getattr(importlib.import_module(OFFLOAD_MODULE), OFFLOAD_CLASS)


def _build_wrappers(targets, ledger):
    """The two methods installed on DeepSpeedZeRoOffload. See NOTE [ Parameter lifecycle under recompute ]."""
    import torch

    forward_release = targets.originals["post_sub_module_forward_function"]
    backward_fetch = targets.originals["pre_sub_module_backward_function"]
    backward_release = targets.originals["post_sub_module_backward_function"]
    current_graph_task = torch._C._current_graph_task_id

    @functools.wraps(forward_release)
    def post_sub_module_forward_function(self, sub_module):
        if current_graph_task() == -1:
            if ledger.has_stale():
                ledger.sweep_stale()
            return forward_release(self, sub_module)
        held = ledger.hold(self, sub_module)
        try:
            return forward_release(self, sub_module)
        finally:
            ledger.undo_shrink(held)

    @functools.wraps(backward_fetch)
    def pre_sub_module_backward_function(self, sub_module):
        ledger.backward_fetched(self, sub_module)
        return backward_fetch(self, sub_module)

    @functools.wraps(backward_release)
    def post_sub_module_backward_function(self, sub_module):
        ledger.drop(sub_module)
        return backward_release(self, sub_module)

    return {
        "post_sub_module_forward_function": post_sub_module_forward_function,
        "pre_sub_module_backward_function": pre_sub_module_backward_function,
        "post_sub_module_backward_function": post_sub_module_backward_function,
    }


def _check_version() -> PatchStatus:
    try:
        text = deepspeed_version()
    except ImportError as exc:
        return PatchStatus("no-deepspeed", None, f"deepspeed cannot be imported: {exc}")
    kind = versions.classify(versions.parse(text))
    if kind == "upstream":
        return PatchStatus("upstream", text, f"deepspeed >= {versions.render(versions.FIRST_UPSTREAM_HANDLED)} "
                           "handles checkpoint recompute of frozen params itself; nothing patched")
    if kind == "unsupported":
        return PatchStatus("unsupported", text,
                           f"expected deepspeed {versions.patched_range()}, got {text}; nothing patched")
    return PatchStatus("not-applied", text, "supported deepspeed, patch not applied")


def _patched_status(version: str) -> PatchStatus:
    return PatchStatus("patched", version, f"frozen params survive checkpoint recompute; to turn off, {DISABLE_HINT}",
                       POLICY)


def apply(auto: bool = False) -> PatchStatus:
    """Patch the installed deepspeed. Idempotent.

    Called explicitly (auto=False), an unsupported version or a changed target raises
    UnsupportedDeepSpeedVersion or PatchTargetMismatch. In auto mode it logs one line instead.
    Either way deepspeed is left exactly as it was unless every check passed.
    """
    global _ledger
    with _lock:
        found = _check_version()
        if found.mode == "upstream":
            return found
        if found.mode in ("unsupported", "no-deepspeed"):
            return _refuse(found, UnsupportedDeepSpeedVersion(versions.patched_range(), found.deepspeed_version
                                                              or "no importable deepspeed"), auto)
        try:
            offload_cls = _offload_class()
            if MARKER in vars(offload_cls):
                return _patched_status(found.deepspeed_version)
            from zero3_recompute.lifecycle import HoldLedger
            from zero3_recompute.targets import resolve

            targets = resolve()
        except PatchTargetMismatch as exc:
            return _refuse(PatchStatus("mismatch", found.deepspeed_version, str(exc)), exc, auto)
        ledger = HoldLedger(targets)
        wrappers = _build_wrappers(targets, ledger)
        for name, wrapper in wrappers.items():
            setattr(targets.offload_cls, name, wrapper)
        setattr(targets.offload_cls, MARKER, dict(targets.originals))
        _ledger = ledger
        logger.info("%s", _patched_status(found.deepspeed_version))
        return _patched_status(found.deepspeed_version)


def _refuse(found: PatchStatus, error: Zero3RecomputeError, auto: bool) -> PatchStatus:
    if not auto:
        raise error
    logger.warning("%s", found)
    return found


def revert() -> PatchStatus:
    """Restore deepspeed's original methods. Harmless when nothing is patched."""
    global _ledger
    with _lock:
        found = _check_version()
        if found.mode != "not-applied":
            return found
        offload_cls = _offload_class()
        originals = vars(offload_cls).get(MARKER)
        if originals is None:
            return found
        for name, original in originals.items():
            setattr(offload_cls, name, original)
        delattr(offload_cls, MARKER)
        if _ledger is not None:
            _ledger.release_everything()
            _ledger = None
        return PatchStatus("not-applied", found.deepspeed_version, "reverted: deepspeed's original methods restored")


def status() -> PatchStatus:
    """Report without changing anything."""
    with _lock:
        found = _check_version()
        if found.mode != "not-applied":
            return found
        if MARKER in vars(_offload_class()):
            return _patched_status(found.deepspeed_version)
        return found


def held_params():
    """Frozen params currently held gathered since a recompute (for tests and diagnostics)."""
    with _lock:
        return [] if _ledger is None else _ledger.held_params()
