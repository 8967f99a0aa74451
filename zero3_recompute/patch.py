"""apply() / revert() / status(): the patch's life cycle over the installed deepspeed.

apply() checks the deepspeed version first, then resolves and fingerprints every target
(targets.resolve) before it changes anything, so a mismatch leaves deepspeed untouched. The
originals are read from ``vars(cls)`` and kept under a marker attribute on the class; that
marker makes apply() idempotent and lets revert() put back the exact original objects.
"""
import functools
import importlib
import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from zero3_recompute import policies, versions
from zero3_recompute.errors import (PatchTargetMismatch, RevertRefused, UnknownLayer, UnknownPolicy,
                                    UnsupportedDeepSpeedVersion, Zero3RecomputeError)

logger = logging.getLogger("zero3_recompute")

MARKER = "__zero3_recompute_originals__"
# Layers named here (comma-separated, of LAYERS) are left out when apply() patches, for diagnosis.
# Read then only: a later apply() that only switches the policy keeps them as they are; revert()
# and apply() again re-reads it.
ENV_LAYERS_OFF = "ZERO3_RECOMPUTE_LAYERS_OFF"
# The optional layers over the core: zero3_recompute.placeholders, .deferral, .kept_storage,
# .live_budget, .hook_stack, .mixed_dtype_gather and .root_fetch (each module's LAYER, repeated here: the
# start-up hook reads this without importing them, and test_layer_switches checks that they agree).
LAYERS = ("placeholders", "deferral", "kept_storage", "live_budget", "hook_stack", "mixed_dtype_gather", "root_fetch")


# What an Install is: one of deepspeed's hooks or its coordinator's reset_step, wrapped (WRAPPER);
# a piece of deepspeed's own handling, switched off (UPSTREAM); else the name of the layer it
# belongs to (torch's saved-tensors bindings, mirrored, are hook_stack's).
WRAPPER, UPSTREAM = "wrapper", "upstream"


class Install(NamedTuple):
    """One replacement apply() made, as revert() undoes it: owner.name was original."""
    owner: Any
    name: str
    original: Callable
    replacement: Callable
    role: str

    def in_place(self) -> bool:
        """Whether owner.name is still ours (not replaced again after apply())."""
        return vars(self.owner).get(self.name) is self.replacement

    def where(self) -> str:
        return f"{getattr(self.owner, '__name__', self.owner)}.{self.name}"

DISABLE_HINT = "set ZERO3_RECOMPUTE_DISABLE=1 before starting Python, or call zero3_recompute.revert()"

_lock = threading.RLock()
_ledger = None
# The last refusal of this process, until a later apply() patches: status() reports it rather
# than 'not-applied', so doctor and the user see why nothing is patched.
_refusal: Optional["PatchStatus"] = None
# The refusal auto mode last warned of: the same one is not logged twice in a process.
_warned: Optional["PatchStatus"] = None


@dataclass(frozen=True)
class PatchStatus:
    """Where the patch stands.

    mode is one of:
      'patched'      our handling is installed on deepspeed's ZeRO-3 hooks;
      'upstream'     deepspeed's own recompute handling (PR #8148, 0.19.3 on) is in charge,
                     nothing is patched (policy 'upstream', or not applied where it exists);
      'not-applied'  a supported deepspeed that is not patched (yet, or after revert());
      'unsupported'  a deepspeed version outside the supported range, nothing is patched;
      'mismatch'     a patch target changed shape, nothing is patched;
      'no-deepspeed' deepspeed cannot be imported.
    """

    mode: str
    deepspeed_version: Optional[str]
    detail: str
    policy: Optional[str] = None
    # How the saved-tensors hook in force is read, while patched (targets.SavedTensorsProbe).
    mechanism: Optional[str] = None
    # The pieces of deepspeed's own handling switched off while patched, as owner.name.
    switched_off: Tuple[str, ...] = ()
    # Why apply() refused to patch (modes in REFUSALS): what it expected and what it found.
    refusal: Optional[str] = None
    # Where deepspeed's own recompute handling was found (module.name), in mode 'upstream'.
    upstream_handling: Optional[str] = None
    # While patched: whether gathered storage kept outside saved tensors is freed and refilled
    # (NOTE [ Gathered storage kept outside saved tensors ]); False where torch cannot count a
    # storage's references.
    frees_kept_storage: bool = False
    # While patched: the optional layers installed (zero3_recompute.mixed_dtype_gather.LAYER), and
    # why the mixed-dtype gather layer is or is not (NOTE [ Mixed-dtype gathers ]).
    layers: Tuple[str, ...] = ()
    gather_fix: Optional[str] = None

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


# Modes in which apply() refused to patch anything.
REFUSALS = ("unsupported", "mismatch")


def deepspeed_version() -> str:
    """The installed deepspeed's version, readable while deepspeed is still importing."""
    return importlib.import_module("deepspeed.git_version_info").version


def _offload_class():
    from zero3_recompute.targets import OFFLOAD_CLASS, OFFLOAD_MODULE

    return getattr(importlib.import_module(OFFLOAD_MODULE), OFFLOAD_CLASS)


def _forward_fetch_wrapper(targets, ledger, layers_off: Tuple[str, ...]):
    """The forward fetch's method installed on DeepSpeedZeRoOffload, and the root_fetch layer over it
    (None where switched off; NOTE [ Forward fetch at the root alone ])."""
    from zero3_recompute import root_fetch as root_fetch_layer

    forward_fetch, kept = targets.originals["pre_sub_module_forward_function"], ledger.kept_storage

    @functools.wraps(forward_fetch)
    def pre_sub_module_forward_function(self, sub_module):
        if ledger.retired:
            return forward_fetch(self, sub_module)
        if sub_module is self.module:
            ledger.forward_fetching(self, sub_module)
            if root_fetch is not None:
                root_fetch.take_on(self)
        result = forward_fetch(self, sub_module)
        if kept.engaged:
            kept.after_fetch(sub_module)
        return result

    root_fetch = (root_fetch_layer.RootFetch(targets, pre_sub_module_forward_function, ledger.forward_fetching)
                  if root_fetch_layer.LAYER not in layers_off else None)
    if root_fetch is not None:
        kept.on_engaged = root_fetch.stop  # its refill reads every fetch (rule 4 of the NOTE)
    return pre_sub_module_forward_function, root_fetch


def _backward_release_wrapper(targets, ledger):
    """The backward release's method installed on DeepSpeedZeRoOffload: rule 7's test and rule 5's count,
    then HoldLedger.before_backward_release, whose case of an open task without placeholders it makes
    itself, without that frame (lifecycle NOTE, rule 2)."""
    import torch

    from zero3_recompute.targets import has_children

    backward_release, kept = targets.originals["post_sub_module_backward_function"], ledger.kept_storage
    current_graph_task, books, holds = torch._C._current_graph_task_id, ledger.books, ledger.holds
    recomputing, nothing_below = ledger.engines.recomputing, ledger.leftovers.nothing_below  # rule 7's test; rule 2's
    due_key = ledger.calls_due.key  # rule 5's count (holds.CallsDue), taken here without its frame

    @functools.wraps(backward_release)
    def post_sub_module_backward_function(self, sub_module):
        if ledger.retired:
            return backward_release(self, sub_module)
        if id(self) not in recomputing:
            notes = sub_module.__dict__
            count = notes.get(due_key)
            if count:
                notes[due_key] = count - 1
            return backward_release(self, sub_module)
        graph_task = current_graph_task()
        task = books.tasks.get(graph_task)
        if task is None or task.placeholders:
            ledger.before_backward_release(self, sub_module)
        else:  # before_backward_release in an open task without placeholders, without its frame
            notes = sub_module.__dict__
            count = notes.get(due_key)
            if count:
                notes[due_key] = count - 1
            if has_children(sub_module) and not nothing_below(self, sub_module, task, holds, graph_task):
                ledger.release_below(self, sub_module, task, graph_task)
            task.due.pop(id(sub_module), None)  # one key of an open task: no lock (lifecycle NOTE, rule 2)
            if id(sub_module) in holds.by_module:
                holds.drop(id(sub_module), ledger.lock)
        if not kept.engaged:
            return backward_release(self, sub_module)
        release = kept.before_release(self, sub_module)
        result = backward_release(self, sub_module)
        kept.after_release(release)
        return result

    return post_sub_module_backward_function


def _build_wrappers(targets, ledger, layers_off: Tuple[str, ...]):
    """The methods installed on DeepSpeedZeRoOffload (the NOTEs of lifecycle and kept_storage), and
    the root_fetch layer over the forward fetch's (None where switched off)."""
    import torch

    forward_release, backward_fetch = (targets.originals[name] for name in (
        "post_sub_module_forward_function", "pre_sub_module_backward_function"))
    pre_sub_module_forward_function, root_fetch = _forward_fetch_wrapper(targets, ledger, layers_off)
    current_graph_task, kept, books = torch._C._current_graph_task_id, ledger.kept_storage, ledger.books
    recomputing = ledger.engines.recomputing  # rule 7's test
    grad_enabled, any_hook = torch.is_grad_enabled, ledger.engines.any_hook
    due_key = ledger.calls_due.key  # rule 5's count (holds.CallsDue), added and taken here without its frames
    # A forward past its notes (Engines.forward_noted), nothing queued, no stack to settle: forward_done counts alone.
    noted, queued = ledger.engines.forward_noted if targets.saved_tensors.settle is None else (), ledger.books.queued

    @functools.wraps(forward_release)
    def post_sub_module_forward_function(self, sub_module):
        if ledger.retired:
            return forward_release(self, sub_module)
        if current_graph_task() == -1:
            if id(self) not in recomputing and grad_enabled() and any_hook() is None:  # outside any checkpoint
                notes = sub_module.__dict__  # rule 5 counts every engine's calls: one may checkpoint later
                notes[due_key] = notes.get(due_key, 0) + 1
                return forward_release(self, sub_module)
            if id(self) not in noted or sub_module is self.module or queued or ledger.defers_fetches:
                ledger.forward_done(self, sub_module)
            elif grad_enabled():
                notes = sub_module.__dict__
                notes[due_key] = notes.get(due_key, 0) + 1
            if not kept.engaged:
                return forward_release(self, sub_module)
            plan = None
        else:
            plan = ledger.before_recompute_release(self, sub_module)
            if not (plan.gathered or plan.placeholder_candidates):
                plan = None  # after_recompute_release would do nothing
                if not kept.engaged:
                    return forward_release(self, sub_module)
        release = kept.before_release(self, sub_module) if kept.engaged else None
        try:
            return forward_release(self, sub_module)
        finally:
            if plan is not None:
                ledger.after_recompute_release(plan)
            if release is not None:
                kept.after_release(release)

    @functools.wraps(backward_fetch)
    def pre_sub_module_backward_function(self, sub_module):
        if ledger.retired or id(self) not in recomputing:
            return backward_fetch(self, sub_module)
        task = books.tasks.get(current_graph_task())
        if task is not None and id(self) in task.engines_noted and not (task.placeholders or ledger.defers_fetches):
            task.due[id(sub_module)] = (self, sub_module)  # backward_fetched, its task's books noted, without its frame
        elif ledger.backward_fetched(self, sub_module):
            return None  # deferred to the recompute that is about to rerun this module
        result = backward_fetch(self, sub_module)
        if kept.engaged:
            kept.after_fetch(sub_module)
        return result

    post_sub_module_backward_function = _backward_release_wrapper(targets, ledger)

    # After revert(), a wrapper installed over ours keeps calling ours: retired, it is deepspeed's method alone.
    wrappers = (pre_sub_module_forward_function, post_sub_module_forward_function, pre_sub_module_backward_function,
                post_sub_module_backward_function)
    return [Install(targets.offload_cls, w.__name__, targets.originals[w.__name__], w, WRAPPER)
            for w in wrappers], root_fetch


def _reset_step_wrapper(targets, ledger):
    """The coordinator's reset_step, after the sweep of every graph task of that coordinator
    that a raised backward left on the books (lifecycle NOTE, rule 4)."""
    reset_step = targets.reset_step

    @functools.wraps(reset_step)
    def wrapped_reset_step(self):
        if not ledger.retired:
            ledger.close_ended(self)
        return reset_step(self)

    return wrapped_reset_step


def _check_version() -> PatchStatus:
    try:
        text = deepspeed_version()
    except ImportError as exc:
        return PatchStatus("no-deepspeed", None, f"deepspeed cannot be imported: {exc}")
    if versions.classify(versions.parse(text)) == "unsupported":
        return PatchStatus("unsupported", text,
                           f"expected deepspeed {versions.at_least()}, got {text}; nothing patched")
    return PatchStatus("not-applied", text, "supported deepspeed, patch not applied")


def _unpatched_status(version: str, detail: str, left: str = "") -> PatchStatus:
    """Not patched: deepspeed's own recompute handling is in charge where it has one. ``left``
    names what revert() left in place, in either mode."""
    from zero3_recompute.targets import upstream_handling

    found = upstream_handling()
    suffix = f"; {left}" if left else ""
    if found is None:
        return PatchStatus("not-applied", version, detail + suffix)
    return PatchStatus("upstream", version, f"deepspeed's own recompute handling is in charge (found {found}); "
                       f"nothing patched; apply() or policy auto/keep/release takes over{suffix}",
                       policies.UPSTREAM, upstream_handling=found)


def _patched_status(version: str) -> PatchStatus:
    from zero3_recompute import root_fetch
    from zero3_recompute.lifecycle import layers_in_force

    marker = vars(_offload_class())[MARKER]
    mechanism = marker["saved_tensors"]
    detail = (f"frozen params survive checkpoint recompute; saved-tensors hooks read by {mechanism}; "
              f"to turn off, {DISABLE_HINT}")
    switched = tuple(install.where() for install in marker["installs"] if install.role == UPSTREAM)
    if switched:
        detail += "; took over from deepspeed's own handling, switched off: " + ", ".join(switched)
    layers = (layers_in_force(_ledger) + tuple(install.role for install in marker["installs"] if install.role in LAYERS)
              + ((root_fetch.LAYER, ) if marker["root_fetch"] is not None and not marker["root_fetch"].stopped else ()))
    return PatchStatus("patched", version, detail, _ledger.policy.name, mechanism, switched,
                       frees_kept_storage=_ledger.kept_storage.enabled, layers=layers,
                       gather_fix=marker["gather_fix"])


def layers_switched_off() -> Tuple[str, ...]:
    """The layers ENV_LAYERS_OFF names; UnknownLayer for a name not in LAYERS."""
    names = tuple(name.strip() for name in os.environ.get(ENV_LAYERS_OFF, "").split(",") if name.strip())
    unknown = [name for name in names if name not in LAYERS]
    if unknown:
        raise UnknownLayer(f"{ENV_LAYERS_OFF} naming some of {', '.join(LAYERS)}", ",".join(unknown))
    return names


def _layer_installs(targets, ledger, layers_off: Tuple[str, ...]) -> Tuple[List[Install], str]:
    """Each optional layer to install, and what to say of the mixed-dtype gather. A layer retires
    with the ledger: under someone who wrapped it after apply(), it then passes calls through."""
    from zero3_recompute import mixed_dtype_gather
    from zero3_recompute.targets import COALESCED_GATHER

    fix = targets.gather_fix
    if not fix.needed:
        return [], fix.reason
    if mixed_dtype_gather.LAYER in layers_off:
        return [], f"switched off ({ENV_LAYERS_OFF}); needed: {fix.reason}"
    replacement = mixed_dtype_gather.one_dtype_at_a_time(fix.original, retired=lambda: ledger.retired)
    return [Install(fix.owner, COALESCED_GATHER, fix.original, replacement, mixed_dtype_gather.LAYER)], \
        f"fixed, one dtype gathered at a time: {fix.reason}"


def _switched_off(original, piece, ledger):
    """A stand-in for an upstream piece while our handling is in charge: does nothing, or, for a
    coordinator method marked own_where_no_books, runs deepspeed's own for a coordinator whose
    backwards the ledger keeps no books for (stock's path)."""
    if piece.own_where_no_books:

        @functools.wraps(original)
        def own_where_no_books(self, *args, **kwargs):
            if ledger.retired or not ledger.engines.keeps_books_for(self):
                return original(self, *args, **kwargs)
            return None

        return own_where_no_books

    @functools.wraps(original)
    def switched_off(*args, **kwargs):
        return None

    return switched_off


def apply(auto: bool = False, policy: Optional[str] = None) -> PatchStatus:
    """Patch the installed deepspeed with a release policy (zero3_recompute.policies). Idempotent.

    ``policy`` defaults to $ZERO3_RECOMPUTE_POLICY, else 'auto'; once patched, a call without
    ``policy`` keeps the policy in force, and one naming another policy switches to it. Where
    deepspeed has its own recompute handling (0.19.3 on), every policy but 'upstream' switches
    that handling off (targets.UPSTREAM_PIECES) and 'upstream' leaves it in charge, unpatched.
    Called explicitly (auto=False), an unsupported version, an unknown policy or a changed
    target raises UnsupportedDeepSpeedVersion, UnknownPolicy or PatchTargetMismatch. In auto
    mode it logs one line instead. Either way deepspeed is left exactly as it was unless every
    check passed.
    """
    global _ledger, _refusal
    with _lock:
        found = _check_version()
        if found.mode != "not-applied":
            return _refuse(found, UnsupportedDeepSpeedVersion(versions.at_least(), found.deepspeed_version
                                                              or "no importable deepspeed"), auto)
        version = found.deepspeed_version
        if policy is None and MARKER in vars(_offload_class()):
            return _patched_status(version)
        try:
            from zero3_recompute.targets import upstream_handling

            name = policies.requested(policy)
            layers_off = layers_switched_off()
            upstream = upstream_handling() is not None
            if name == policies.UPSTREAM and upstream:
                _unpatch()
                return _unpatched_status(version, "")
            chosen = policies.for_patching(name, replaces_upstream=upstream)
        except (UnknownPolicy, UnknownLayer) as exc:
            return _refuse(PatchStatus(found.mode, version, str(exc)), exc, auto)
        except PatchTargetMismatch as exc:
            return _refuse(PatchStatus("mismatch", version, str(exc)), exc, auto)
        try:
            offload_cls = _offload_class()
            if MARKER in vars(offload_cls):
                _ledger.switch_policy(chosen)
                return _patched_status(version)
            from zero3_recompute import hook_stack
            from zero3_recompute.lifecycle import HoldLedger
            from zero3_recompute.targets import resolve

            targets = resolve(layers_off)
            targets = replace(targets, saved_tensors=hook_stack.reader(targets.saved_tensors))
        except PatchTargetMismatch as exc:
            return _refuse(PatchStatus("mismatch", version, str(exc)), exc, auto)
        ledger = HoldLedger(targets, chosen, layers_off)
        layers, gather_fix = _layer_installs(targets, ledger, layers_off)
        wrappers, root_fetch = _build_wrappers(targets, ledger, layers_off)
        installs = [
            *wrappers,
            Install(targets.coordinator_cls, "reset_step", targets.reset_step, _reset_step_wrapper(targets, ledger),
                    WRAPPER),
            *(Install(owner, name, original, _switched_off(original, piece, ledger), UPSTREAM)
              for owner, name, original, piece in targets.upstream),
            *(Install(owner, name, original, replacement, hook_stack.LAYER)
              for owner, name, original, replacement in targets.saved_tensors.installs),
            *layers,
        ]
        for install in installs:
            setattr(install.owner, install.name, install.replacement)
        setattr(targets.offload_cls, MARKER, {"installs": installs, "gather_fix": gather_fix,
                                              "saved_tensors": targets.saved_tensors.mechanism,
                                              "root_fetch": root_fetch})
        _ledger = ledger
        _refusal = None
        patched = _patched_status(version)
        logger.info("%s", patched)
        return patched


def _refuse(found: PatchStatus, error: Zero3RecomputeError, auto: bool) -> PatchStatus:
    """Record the refusal; raise it (explicit apply) or warn once per process (auto mode)."""
    global _refusal, _warned
    if found.mode in REFUSALS:
        found = replace(found, refusal=str(error).removeprefix("zero3_recompute: "))
        _refusal = found
    if not auto:
        raise error
    if found != _warned:
        _warned = found
        logger.warning("%s; works with %s", found, versions.working_pairings())
    return found


def _unpatch() -> Optional[List[str]]:
    """Put back every original object apply() replaced that is still ours, as ddtrace's unwrap
    does; returns the names left in place because someone replaced them after us (ours, under
    theirs, is retired: it passes every call to deepspeed's method), or None when nothing was
    patched."""
    global _ledger
    offload_cls = _offload_class()
    originals = vars(offload_cls).get(MARKER)
    if originals is None:
        return None
    from zero3_recompute import hook_stack

    freed = _ledger.kept_storage.freed_in_use() if _ledger is not None else 0
    if freed:
        raise RevertRefused("no graph still referencing a gathered storage the package freed (run its backward, "
                            "or drop it, first: only the package refills it at the next fetch)",
                            f"{freed} such storage{'s' if freed > 1 else ''}")
    if originals["root_fetch"] is not None:
        originals["root_fetch"].stop()  # each engine's bypass off, before the class's methods go back
    left = []
    for install in originals["installs"]:
        if install.in_place():
            setattr(install.owner, install.name, install.original)
        elif install.role != hook_stack.LAYER:
            # Under someone who wrapped the torch mirror after us, ours stays: it only mirrors the
            # stack (NOTE [ Reading the saved-tensors hook stack ]), so it is not reported.
            left.append(install.where())
    delattr(offload_cls, MARKER)
    if _ledger is not None:
        _ledger.switch_policy(_ledger.policy, retire=True)
        _ledger = None
    return left


def revert() -> PatchStatus:
    """Restore deepspeed's original objects. Harmless when nothing is patched. Raises RevertRefused,
    changing nothing, while a graph of a forward that ran patched still references a gathered
    storage the package freed (NOTE [ Gathered storage kept outside saved tensors ])."""
    global _refusal
    with _lock:
        found = _check_version()
        if found.mode != "not-applied":
            return found
        _refusal = None
        left = _unpatch()
        if left is None:
            return _unpatched_status(found.deepspeed_version, found.detail)
        if left:
            logger.warning("zero3_recompute: revert() left %s in place: replaced again after apply(); the package's "
                           "wrappers beneath pass every call to deepspeed's methods", ", ".join(left))
            return _unpatched_status(found.deepspeed_version, "reverted: deepspeed's original methods restored",
                                     f"left in place: {', '.join(left)}, replaced after apply() (ours beneath passes "
                                     "calls through)")
        return _unpatched_status(found.deepspeed_version, "reverted: deepspeed's original methods restored")


def status() -> PatchStatus:
    """Report without changing anything."""
    with _lock:
        found = _check_version()
        if found.mode != "not-applied":
            return found
        if MARKER in vars(_offload_class()):
            return _patched_status(found.deepspeed_version)
        if _refusal is not None:
            return _refusal
        return _unpatched_status(found.deepspeed_version, found.detail)


def held_params():
    """Frozen params currently held gathered since a recompute (for tests and diagnostics)."""
    with _lock:
        if _ledger is None:
            return []
        with _ledger.lock:
            return _ledger.holds.params()


def graph_tasks_on_the_books() -> int:
    """Backward graph tasks the package keeps books for (each with a callback and a finalizer
    queued with torch), for tests and diagnostics: none in a model no checkpoint ran in."""
    with _lock:
        if _ledger is None:
            return 0
        with _ledger.lock:
            return len(_ledger.books)
