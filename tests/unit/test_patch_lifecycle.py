"""apply() / revert() / status() and auto-activation, in one process, against the installed deepspeed."""
import importlib
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

import zero3_recompute
from zero3_recompute import patch, targets, versions
from zero3_recompute.errors import PatchTargetMismatch, UnsupportedDeepSpeedVersion

from tests.unit.interpreters import run_together
from tests.unit.patch_switch import patch_reverted

PATCHED = versions.classify(versions.parse(patch.deepspeed_version())) != "unsupported"
needs_patch_range = pytest.mark.skipif(not PATCHED, reason=f"deepspeed {patch.deepspeed_version()} is not "
                                       f"in the patched range {versions.at_least()}")
# deepspeed's own recompute handling (0.19.3 on), found in the installed code.
UPSTREAM_INSTALLED = PATCHED and targets.upstream_handling() is not None
needs_upstream = pytest.mark.skipif(not UPSTREAM_INSTALLED, reason="only where deepspeed ships its own handling")
UNPATCHED_MODE = "upstream" if UPSTREAM_INSTALLED else "not-applied"


def _offload_attributes():
    cls = patch._offload_class()
    return {name: vars(cls).get(name) for name in (*targets.WRAPPED_METHODS, patch.MARKER)}


@pytest.fixture
def pristine():
    """Start from unpatched deepspeed and leave the patch as the test found it."""
    with patch_reverted():
        yield _offload_attributes()


@pytest.mark.once_per_run
@pytest.mark.parametrize("text, kind", [("0.13.1", "unsupported"), ("0.14.4", "unsupported"), ("0.14.5", "patch"),
                                        ("0.16.9+abc123", "patch"), ("0.19.2", "patch"), ("0.19.3", "upstream"),
                                        ("0.20.0", "upstream"), ("not a version", "unsupported")])
def test_version_classification(text, kind):
    assert versions.classify(versions.parse(text)) == kind


@needs_patch_range
def test_apply_twice_then_revert_restores_the_exact_originals(pristine):
    originals = pristine
    assert originals[patch.MARKER] is None
    pristine_reset_step = vars(_coordinator_class())["reset_step"]
    first = zero3_recompute.apply()
    installed = _offload_attributes()
    second = zero3_recompute.apply()
    assert first.active and second.active and zero3_recompute.status().active
    assert _offload_attributes() == installed, "a second apply() must change nothing"
    for name in targets.WRAPPED_METHODS:
        assert installed[name] is not originals[name]
        assert installed[name].__wrapped__ is originals[name]
    coordinator = _coordinator_class()
    assert vars(coordinator)["reset_step"].__wrapped__ is pristine_reset_step
    reverted = zero3_recompute.revert()
    assert reverted.mode == UNPATCHED_MODE and not zero3_recompute.status().active
    assert vars(coordinator)["reset_step"] is pristine_reset_step, "reset_step is not deepspeed's original"
    after = _offload_attributes()
    for name in targets.WRAPPED_METHODS:
        assert after[name] is originals[name], f"{name} is not deepspeed's original object"
    assert after[patch.MARKER] is None
    assert zero3_recompute.revert().mode == UNPATCHED_MODE, "a second revert() must be harmless"
    assert _offload_attributes() == after


@needs_patch_range
@pytest.mark.parametrize("name", targets.WRAPPED_METHODS)
def test_revert_leaves_a_later_wrapper_in_place(pristine, name):
    """As ddtrace's unwrap: revert() puts back only what is still its own. A wrapper installed
    after apply() stays, and is named; the others are deepspeed's originals again. A later
    apply() finds that wrapper where deepspeed's method was, refuses, and changes nothing."""
    originals = pristine
    zero3_recompute.apply()
    cls = patch._offload_class()
    ours = vars(cls)[name]

    def theirs(self, sub_module):
        return ours(self, sub_module)

    setattr(cls, name, theirs)
    try:
        reverted = zero3_recompute.revert()
        after = _offload_attributes()
        assert after[name] is theirs, "revert() replaced a wrapper that is not its own"
        assert f"{cls.__name__}.{name}" in reverted.detail, reverted.detail
        assert all(after[other] is originals[other] for other in targets.WRAPPED_METHODS if other != name)
        assert after[patch.MARKER] is None and not zero3_recompute.status().active
        with pytest.raises(PatchTargetMismatch, match=name):
            zero3_recompute.apply()
        assert _offload_attributes() == after
    finally:
        setattr(cls, name, originals[name])


@needs_patch_range
def test_unsupported_version_raises_and_patches_nothing(pristine, monkeypatch, caplog):
    monkeypatch.setattr(patch, "deepspeed_version", lambda: "0.13.1")
    with pytest.raises(UnsupportedDeepSpeedVersion, match=r"expected >=0\.14\.5, got 0\.13\.1"):
        zero3_recompute.apply()
    caplog.clear()
    with caplog.at_level("INFO", logger="zero3_recompute"):
        found = patch.apply(auto=True)
    assert found.mode == "unsupported" and not found.active
    assert found.refusal == "unsupported deepspeed version: expected >=0.14.5, got 0.13.1", "the refusal is a field, not prose"
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and messages[0].startswith(str(found)), "auto mode logs exactly one line"
    assert "expected deepspeed >=0.14.5, got 0.13.1" in messages[0] and "works with torch" in messages[0]
    assert caplog.records[0].levelname == "WARNING"
    caplog.clear()
    with caplog.at_level("INFO", logger="zero3_recompute"):
        assert patch.apply(auto=True) == found
    assert not caplog.records, "the same refusal is logged once per process"
    assert _offload_attributes() == pristine


def _coordinator_class():
    return getattr(importlib.import_module(targets.COORDINATOR_MODULE), targets.COORDINATOR_CLASS)


def _deepspeed_attributes():
    """Every class attribute of the two classes we touch, by identity."""
    return {(cls.__name__, name): value for cls in (patch._offload_class(), _coordinator_class())
            for name, value in vars(cls).items()}


@needs_patch_range
@pytest.mark.parametrize("broken", ["signature", "missing", "renamed", "body", "coordinator"])
def test_changed_target_raises_and_patches_nothing(pristine, monkeypatch, broken):
    cls = patch._offload_class()
    if broken == "signature":
        monkeypatch.setattr(cls, "post_sub_module_backward_function", lambda self, sub_module, extra: None)
        expected = r"expected signature \(self, sub_module\), got \(self, sub_module, extra\)"
    elif broken == "missing":
        monkeypatch.delattr(cls, "post_sub_module_backward_function")
        expected = r"expected a function defined on the class, got None"
    elif broken == "renamed":
        # As if a release renamed the method: the old name gone, a new one in its place.
        monkeypatch.setattr(cls, "post_sub_module_forward_hook", vars(cls)["post_sub_module_forward_function"],
                            raising=False)
        monkeypatch.delattr(cls, "post_sub_module_forward_function")
        expected = r"post_sub_module_forward_function changed: expected a function defined on the class, got None"
    elif broken == "body":
        monkeypatch.setattr(cls, "pre_sub_module_backward_function", lambda self, sub_module: None)
        expected = r"expected a body that calls get_param_coordinator, fetch_sub_module"
    else:
        monkeypatch.delattr(_coordinator_class(), targets.RELEASE_PARAM)
        expected = r"__release_param changed: expected a function defined on the class, got None"
    changed = _deepspeed_attributes()
    with pytest.raises(PatchTargetMismatch, match=expected):
        zero3_recompute.apply()
    refused = patch.apply(auto=True)
    assert refused.mode == "mismatch" and re.search(expected, refused.refusal), refused
    assert zero3_recompute.status().refusal == refused.refusal
    after = _deepspeed_attributes()
    assert after.keys() == changed.keys() and all(after[key] is changed[key] for key in changed), \
        "nothing may be patched when one target changed"


def _contract_inputs():
    """The real (offload class, coordinator class, offload module, partition module)."""
    return (patch._offload_class(), _coordinator_class(), importlib.import_module(targets.OFFLOAD_MODULE),
            importlib.import_module(targets.PARTITION_MODULE))


def _module_of(*functions):
    module = types.ModuleType("changed_deepspeed_module")
    for function in functions:
        function.__module__ = module.__name__
        setattr(module, function.__name__, function)
    return module


def _broken_contract(contract: str):
    """The real inputs with one contract broken, and the contract."""
    offload_cls, coordinator_cls, offload_module, partition_module = _contract_inputs()
    if contract == "release_gate":

        class Coordinator(coordinator_cls):

            def release_sub_module(self, submodule, forward=False):
                for param in submodule.parameters():
                    getattr(self, targets.RELEASE_PARAM)(param)

        def release_param(self, param, free_data=True):
            param.ds_status = None

        setattr(Coordinator, targets.RELEASE_PARAM, release_param)
        return (offload_cls, Coordinator, offload_module, partition_module), targets.RELEASE_GATE
    if contract in ("grads_remaining", "offload_zenflow"):

        def hook(module):
            return module.zenflow if contract == "offload_zenflow" else None

        changed = _module_of(hook) if contract == "grads_remaining" else offload_module
        if contract == "offload_zenflow":

            class Offload(offload_cls):

                def __init__(self, module):
                    self.module = module

            return (Offload, coordinator_cls, changed, partition_module), targets.OFFLOAD_ZENFLOW
        return (offload_cls, coordinator_cls, changed, partition_module), targets.GRADS_REMAINING
    if contract == "final_location":

        def partition(param):
            return param.ds_tensor

        return (offload_cls, coordinator_cls, offload_module, _module_of(partition)), targets.FINAL_LOCATION

    class Offload(offload_cls):

        def __init__(self, module):
            self.zenflow = False
            self.model = module

    return (Offload, coordinator_cls, offload_module, partition_module), targets.OFFLOAD_MODEL


@needs_patch_range
def test_the_contracts_hold_on_the_installed_deepspeed():
    targets._check_contracts(*_contract_inputs())


@needs_patch_range
@pytest.mark.parametrize("contract", ["release_gate", "grads_remaining", "final_location", "offload_model",
                                      "offload_zenflow"])
def test_a_broken_contract_is_refused_by_name(contract):
    """Each contract the hold relies on beyond the wrapped methods, broken alone, is named."""
    inputs, (where, name, role) = _broken_contract(contract)
    if contract == "offload_zenflow" and "zenflow" not in targets._names_read(targets._functions_of(inputs[2])):
        pytest.skip("this deepspeed predates ZenFlow: nothing names it, nothing is checked")
    with pytest.raises(PatchTargetMismatch) as raised:
        targets._check_contracts(*inputs)
    assert str(raised.value).endswith(f"{where} changed: expected code that uses {name} ({role}), "
                                      f"got code without {name}"), str(raised.value)


@needs_patch_range
def test_a_coordinator_without_the_release_gate_is_refused_and_nothing_patched(pristine, monkeypatch):
    coordinator = _coordinator_class()

    def release_sub_module(self, submodule, forward=False):
        return None

    monkeypatch.setattr(coordinator, "release_sub_module", release_sub_module)
    monkeypatch.setattr(coordinator, targets.RELEASE_PARAM, lambda self, param, free_data=True: None)
    before = _deepspeed_attributes()
    with pytest.raises(PatchTargetMismatch, match="ds_active_sub_modules"):
        zero3_recompute.apply()
    assert _deepspeed_attributes() == before and _offload_attributes() == pristine


def _upstream_attributes():
    """deepspeed's own recompute handling, by identity: every piece apply() may switch off."""
    found = {}
    for piece in targets.UPSTREAM_PIECES:
        module = importlib.import_module(piece.module)
        owner = module if piece.cls is None else getattr(module, piece.cls)
        found[piece.where] = vars(owner).get(piece.name)
    return found


class _RecordedCoordinator:
    """Only the record deepspeed's end-of-backward sweep drains: one due module, with no params."""

    def __init__(self):
        import torch

        self.due = {1: torch.nn.Module()}
        self.due[1].ds_recompute_parameters = set()
        self.due[1].ds_external_parameters = lambda: ()

    @property
    def _PartitionedParameterCoordinator__active_backward_submodules(self):
        return self.due


@needs_upstream
def test_taking_over_switches_upstream_handling_off_and_revert_restores_it(pristine):
    before = _upstream_attributes()
    assert all(callable(piece) for piece in before.values())
    patched = zero3_recompute.apply()
    assert patched.mode == "patched" and patched.policy == "auto"
    assert patched.switched_off and all("." in piece for piece in patched.switched_off), patched
    during = _upstream_attributes()
    pieces = {piece.where: piece for piece in targets.UPSTREAM_PIECES}
    for where, original in before.items():
        assert during[where] is not original and during[where].__wrapped__ is original, where
        if not pieces[where].own_where_no_books:
            assert during[where]() is None, f"{where} is switched off"
            continue
        # deepspeed's end-of-backward sweep drains the coordinator's record of modules whose
        # backward release is due: switched off for a coordinator the package keeps books for,
        # deepspeed's own for any other (a model no checkpoint ran in takes stock's path).
        with_books, without_books = _RecordedCoordinator(), _RecordedCoordinator()
        patch._ledger.engines.books_touched(with_books)
        during[where](with_books)
        during[where](without_books)
        assert with_books.due and not without_books.due, \
            f"{where}: due modules left {with_books.due} (books), {without_books.due} (none)"
    zero3_recompute.revert()
    assert _upstream_attributes() == before, "revert() puts back deepspeed's exact objects"
    assert zero3_recompute.status().mode == "upstream"


@needs_upstream
def test_policy_upstream_leaves_deepspeeds_own_handling_in_charge(pristine):
    before = _upstream_attributes()
    assert zero3_recompute.apply(policy="upstream").mode == "upstream"
    assert _offload_attributes() == pristine and _upstream_attributes() == before
    zero3_recompute.apply(policy="keep")
    found = zero3_recompute.apply(policy="upstream")
    assert found.mode == "upstream" and found.policy == "upstream", "upstream after keep unpatches"
    assert _offload_attributes() == pristine and _upstream_attributes() == before


@needs_upstream
def test_a_changed_upstream_piece_raises_and_patches_nothing(pristine, monkeypatch):
    coordinator = _coordinator_class()
    monkeypatch.setattr(coordinator, "release_backward_leftovers", lambda self, everything: None)
    before = _upstream_attributes()
    with pytest.raises(PatchTargetMismatch, match=r"release_backward_leftovers changed: expected signature "
                       r"\(self\), got \(self, everything\)"):
        zero3_recompute.apply()
    assert _offload_attributes() == pristine and _upstream_attributes() == before


def _fresh_interpreters(script: str, *extra_envs, timeout: float):
    """``script`` in a new interpreter per environment (this one's without ZERO3_RECOMPUTE_DISABLE,
    with each of ``extra_envs`` over it), run together; each exits 0."""
    env = {name: value for name, value in os.environ.items() if name != "ZERO3_RECOMPUTE_DISABLE"}
    runs = run_together([([sys.executable, "-c", script], {**env, **extra}) for extra in extra_envs], timeout=timeout)
    for done in runs:
        assert done.returncode == 0, done.stderr
    return runs


def _fresh_interpreter_statuses(*extra_envs):
    """Mode seen by an unchanged script in a new interpreter, one per environment (run together):
    activation comes from the .pth."""
    script = textwrap.dedent("""
        import deepspeed
        import zero3_recompute
        print(zero3_recompute.status().mode)
    """)
    return [done.stdout.strip().splitlines()[-1] for done in _fresh_interpreters(script, *extra_envs, timeout=300)]


@pytest.mark.lane(newest_only=True)
@needs_patch_range
def test_activation_after_deepspeed_was_imported():
    """With the start-up hook opted out, deepspeed imports stock; install() or apply() later
    patches the already-loaded module at once."""
    script = textwrap.dedent("""
        import os
        import deepspeed.runtime.zero.parameter_offload
        import zero3_recompute
        import zero3_recompute.autoload
        before = zero3_recompute.status().mode
        del os.environ["ZERO3_RECOMPUTE_DISABLE"]
        zero3_recompute.autoload.install()
        print(before, zero3_recompute.status().mode)
    """)
    env = dict(os.environ, ZERO3_RECOMPUTE_DISABLE="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == [UNPATCHED_MODE, "patched"]


@pytest.mark.lane(newest_only=True)
@needs_patch_range
def test_installed_pth_activates_and_opt_out_disables():
    assert _fresh_interpreter_statuses({}, {"ZERO3_RECOMPUTE_DISABLE": "1"}) == ["patched", UNPATCHED_MODE]


@pytest.mark.once_per_run
def test_autoload_is_standard_library_only():
    script = textwrap.dedent("""
        import sys
        import zero3_recompute.autoload
        zero3_recompute.autoload.install()
        heavy = sorted(name for name in ("torch", "deepspeed") if name in sys.modules)
        print(",".join(heavy) or "none")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "none"


@pytest.mark.skipif(UPSTREAM_INSTALLED or not PATCHED, reason="only where deepspeed has no handling of its own")
def test_a_version_number_alone_does_not_mean_upstream_handling(pristine, monkeypatch):
    """A source install from the weeks before deepspeed's own handling merged says 0.19.3."""
    monkeypatch.setattr(patch, "deepspeed_version", lambda: "0.19.3")
    assert targets.upstream_handling() is None
    assert zero3_recompute.apply().mode == "patched"


@needs_upstream
def test_upstream_handling_is_found_by_presence_and_named(pristine):
    found = zero3_recompute.status()
    assert found.mode == "upstream" and found.policy == "upstream"
    assert found.upstream_handling and "update_recompute_parameters" in found.upstream_handling, found


@needs_patch_range
def test_policies_are_chosen_kept_and_switched(pristine):
    assert zero3_recompute.apply(policy="keep").policy == "keep"
    installed = _offload_attributes()
    assert zero3_recompute.apply().policy == "keep", "apply() without a policy keeps the one in force"
    assert zero3_recompute.apply(policy="release").policy == "release"
    assert zero3_recompute.status().policy == "release"
    assert _offload_attributes() == installed, "switching policies patches nothing again"


@needs_patch_range
@pytest.mark.parametrize("bad", ["hold", "upstream", 3])
def test_a_bad_policy_raises_and_patches_nothing(pristine, bad):
    from zero3_recompute.errors import UnknownPolicy

    if bad == "upstream" and UPSTREAM_INSTALLED:
        pytest.skip("'upstream' is a policy where deepspeed ships its own handling")
    with pytest.raises(UnknownPolicy, match=r"expected one of auto, keep, release"):
        zero3_recompute.apply(policy=bad)
    assert _offload_attributes() == pristine


@pytest.mark.lane(newest_only=True)
@needs_patch_range
def test_policy_from_the_environment_in_a_fresh_interpreter():
    script = textwrap.dedent("""
        import deepspeed
        import zero3_recompute
        found = zero3_recompute.status()
        print(found.mode, found.policy)
    """)
    keep, done = _fresh_interpreters(script, {"ZERO3_RECOMPUTE_POLICY": "keep"}, {"ZERO3_RECOMPUTE_POLICY": "bogus"},
                                     timeout=300)
    assert keep.stdout.split()[-2:] == ["patched", "keep"]
    expected = ["upstream", "upstream"] if UPSTREAM_INSTALLED else ["not-applied", "None"]
    assert done.stdout.split()[-2:] == expected, "a bad policy leaves deepspeed untouched"
    assert "expected one of auto, keep, release" in done.stderr and "got 'bogus'" in done.stderr


def _modules_at_start_up(*extra_envs) -> list:
    """The modules a bare interpreter has loaded, one per environment (run together)."""
    return [set(done.stdout.split())
            for done in _fresh_interpreters("import sys; print(' '.join(sorted(sys.modules)))", *extra_envs,
                                            timeout=120)]


@pytest.mark.once_per_run
def test_start_up_hook_imports_nothing_it_does_not_need():
    """The .pth runs in every interpreter: armed, it adds the hook's own module and nothing
    else (no importlib.abc, typing or logging) until deepspeed is imported."""
    armed, opted_out = _modules_at_start_up({}, {"ZERO3_RECOMPUTE_DISABLE": "1"})
    assert "zero3_recompute.autoload" in armed, "the start-up hook did not run"
    assert armed - opted_out == {"zero3_recompute", "zero3_recompute.autoload"}
    for heavy in ("importlib.abc", "typing", "logging", "threading"):
        assert heavy in opted_out or heavy not in armed, f"the start-up hook imported {heavy}"


@needs_patch_range
def test_patch_reverted_puts_back_the_policy_it_found(pristine):
    """The tests' own switch: after a stock block, the policy in force before, not the default."""
    assert zero3_recompute.apply(policy="keep").policy == "keep"
    with patch_reverted():
        assert not zero3_recompute.status().active
    assert zero3_recompute.status().policy == "keep"

