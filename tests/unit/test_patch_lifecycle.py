"""apply() / revert() / status() and auto-activation, in one process, against the installed deepspeed."""
import os
import subprocess
import sys
import textwrap

import pytest

import zero3_recompute
from zero3_recompute import patch, targets, versions
from zero3_recompute.errors import PatchTargetMismatch, UnsupportedDeepSpeedVersion

from tests.unit.patch_switch import patch_reverted

PATCHED = versions.classify(versions.parse(patch.deepspeed_version())) == "patch"
needs_patch_range = pytest.mark.skipif(not PATCHED, reason=f"deepspeed {patch.deepspeed_version()} is not "
                                       f"in the patched range {versions.patched_range()}")


def _offload_attributes():
    cls = patch._offload_class()
    return {name: vars(cls).get(name) for name in (*targets.WRAPPED_METHODS, patch.MARKER)}


@pytest.fixture
def pristine():
    """Start from unpatched deepspeed and leave the patch as the test found it."""
    with patch_reverted():
        yield _offload_attributes()


@pytest.mark.parametrize("text, kind", [("0.13.1", "unsupported"), ("0.14.4", "unsupported"), ("0.14.5", "patch"),
                                        ("0.16.9+abc123", "patch"), ("0.19.2", "patch"), ("0.19.3", "upstream"),
                                        ("0.20.0", "upstream"), ("not a version", "unsupported")])
def test_version_classification(text, kind):
    assert versions.classify(versions.parse(text)) == kind


@needs_patch_range
def test_apply_twice_then_revert_restores_the_exact_originals(pristine):
    originals = pristine
    assert originals[patch.MARKER] is None
    first = zero3_recompute.apply()
    installed = _offload_attributes()
    second = zero3_recompute.apply()
    assert first.active and second.active and zero3_recompute.status().active
    assert _offload_attributes() == installed, "a second apply() must change nothing"
    for name in targets.WRAPPED_METHODS:
        assert installed[name] is not originals[name]
        assert installed[name].__wrapped__ is originals[name]
    reverted = zero3_recompute.revert()
    assert reverted.mode == "not-applied" and not zero3_recompute.status().active
    after = _offload_attributes()
    for name in targets.WRAPPED_METHODS:
        assert after[name] is originals[name], f"{name} is not deepspeed's original object"
    assert after[patch.MARKER] is None
    assert zero3_recompute.revert().mode == "not-applied", "a second revert() must be harmless"
    assert _offload_attributes() == after


@needs_patch_range
def test_unsupported_version_raises_and_patches_nothing(pristine, monkeypatch, caplog):
    monkeypatch.setattr(patch, "deepspeed_version", lambda: "0.13.1")
    with pytest.raises(UnsupportedDeepSpeedVersion, match=r"expected >=0\.14\.5,<0\.19\.3, got 0\.13\.1"):
        zero3_recompute.apply()
    caplog.clear()
    with caplog.at_level("INFO", logger="zero3_recompute"):
        found = patch.apply(auto=True)
    assert found.mode == "unsupported" and not found.active
    assert [record.getMessage() for record in caplog.records] == [str(found)], "auto mode logs exactly one line"
    assert "expected deepspeed >=0.14.5,<0.19.3, got 0.13.1" in caplog.records[0].getMessage()
    assert _offload_attributes() == pristine


def _coordinator_class():
    import importlib

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
    assert patch.apply(auto=True).mode == "mismatch"
    after = _deepspeed_attributes()
    assert after.keys() == changed.keys() and all(after[key] is changed[key] for key in changed), \
        "nothing may be patched when one target changed"


@pytest.mark.skipif(PATCHED, reason="only where deepspeed ships its own handling")
def test_upstream_versions_are_left_to_deepspeed():
    before = _offload_attributes()
    assert zero3_recompute.apply().mode == "upstream"
    assert zero3_recompute.status().fixed and not zero3_recompute.status().active
    assert _offload_attributes() == before


def _fresh_interpreter_status(extra_env):
    """Mode seen by an unchanged script in a new interpreter: activation comes from the .pth."""
    script = textwrap.dedent("""
        import deepspeed
        import zero3_recompute
        print(zero3_recompute.status().mode)
    """)
    env = {name: value for name, value in os.environ.items() if name != "ZERO3_RECOMPUTE_DISABLE"}
    env.update(extra_env)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


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
    assert done.stdout.split()[-2:] == ["not-applied", "patched"]


def test_installed_pth_activates_and_opt_out_disables():
    expected = "patched" if PATCHED else "upstream"
    assert _fresh_interpreter_status({}) == expected
    assert _fresh_interpreter_status({"ZERO3_RECOMPUTE_DISABLE": "1"}) == ("not-applied" if PATCHED else "upstream")


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
