"""``python -m zero3_recompute doctor`` and the ``zero3-recompute`` console script, end to end."""
import os
import subprocess
import sys

import pytest

from zero3_recompute import patch, versions

KIND = versions.classify(versions.parse(patch.deepspeed_version()))


def _doctor(*args, opt_out: bool = False, command=None, env=None):
    settings = env or {}
    env = {name: value for name, value in os.environ.items() if name not in ("ZERO3_RECOMPUTE_DISABLE",
                                                                            "ZERO3_RECOMPUTE_POLICY")}
    env.update(settings)
    if opt_out:
        env["ZERO3_RECOMPUTE_DISABLE"] = "1"
    command = command or [sys.executable, "-m", "zero3_recompute"]
    return subprocess.run([*command, "doctor", *args], env=env, capture_output=True, text=True, timeout=600)


ON_STOCK_CRASH = pytest.mark.skipif(KIND != "patch", reason=f"deepspeed {patch.deepspeed_version()} ships its own "
                                    "handling: the reproduction trains without the package")


@ON_STOCK_CRASH
def test_affected_and_fix_active():
    done = _doctor()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stock       crashes: CheckpointError" in done.stdout
    assert "package     trains" in done.stdout
    assert "fix         active: patched, policy auto" in done.stdout
    assert "ZERO3_RECOMPUTE_DISABLE=1" in done.stdout, "it says how to turn the fix off"
    assert done.stdout.rstrip().endswith("verdict: affected, fix active")


@ON_STOCK_CRASH
def test_affected_and_opted_out_exits_non_zero():
    done = _doctor(opt_out=True)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "stock       crashes: CheckpointError" in done.stdout
    assert "fix         NOT active: not-applied" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: affected, fix NOT active")


@pytest.mark.skipif(KIND != "upstream", reason="only where deepspeed ships its own handling")
def test_upstream_deepspeed_taken_over_by_default():
    done = _doctor()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ships its own handling" in done.stdout
    assert "stock       trains" in done.stdout
    assert "fix         active: patched, policy auto" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: fix active, in place of deepspeed's own handling")


@pytest.mark.skipif(KIND != "upstream", reason="only where deepspeed ships its own handling")
@pytest.mark.parametrize("setting", [{"ZERO3_RECOMPUTE_POLICY": "upstream"}, {"ZERO3_RECOMPUTE_DISABLE": "1"}])
def test_upstream_in_charge_names_its_gaps(setting):
    """Never "not affected" where the scenario matrix records crashes of deepspeed's own handling."""
    done = _doctor(env=setting)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fix         NOT active: upstream, policy upstream" in done.stdout
    assert "handling    deepspeed's own, in charge; it still crashes with " in done.stdout
    assert "non_reentrant_checkpoint" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: deepspeed's own handling in charge, with known gaps")


def test_console_script_by_version_only():
    script = os.path.join(os.path.dirname(sys.executable), "zero3-recompute")
    if not os.path.exists(script):
        pytest.skip(f"no console script next to {sys.executable}: the package is not installed in this environment")
    done = _doctor("--no-reproduce", command=[script])
    expected = {"patch": (0, "verdict: affected, fix active"),
                "upstream": (0, "verdict: fix active, in place of deepspeed's own handling")}
    if KIND not in expected:
        pytest.skip(f"deepspeed {patch.deepspeed_version()} is outside the supported range")
    code, verdict = expected[KIND]
    assert (done.returncode, done.stdout.rstrip().splitlines()[-1]) == (code, verdict), done.stdout + done.stderr
