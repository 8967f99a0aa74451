"""``python -m zero3_recompute doctor`` and the ``zero3-recompute`` console script, end to end."""
import functools
import json
import os
import subprocess
import sys

import pytest

from zero3_recompute import patch, versions
from zero3_recompute.torch_recompute import recompute_keeps_frozen_tensors

from tests.unit.interpreters import run_together

KIND = versions.classify(versions.parse(patch.deepspeed_version()))


def _doctor_run(*args, opt_out: bool = False, command=None, env=None):
    """(argv, environment) of a doctor run."""
    settings = env or {}
    env = {name: value for name, value in os.environ.items() if name not in ("ZERO3_RECOMPUTE_DISABLE",
                                                                            "ZERO3_RECOMPUTE_POLICY")}
    env.update(settings)
    if opt_out:
        env["ZERO3_RECOMPUTE_DISABLE"] = "1"
    command = command or [sys.executable, "-m", "zero3_recompute"]
    return [*command, "doctor", *args], env


def _doctor(*args, opt_out: bool = False, command=None, env=None):
    argv, env = _doctor_run(*args, opt_out=opt_out, command=command, env=env)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


# The doctor runs of the tests that share a skip condition, by group and name: the first of those
# tests to read one starts its group's together (run_together: their interpreters' start-up
# overlaps, and deepspeed 0.19.2's import alone takes 8 s on 2 cores); each test reads its own.
RUN_GROUPS = {
    "stock_crashes": {"fix_active": ((), {}), "opted_out": ((), {"opt_out": True}),
                      "no_reproduce": (("--no-reproduce",), {})},
    "upstream": {"taken_over": ((), {}), "policy_upstream": ((), {"env": {"ZERO3_RECOMPUTE_POLICY": "upstream"}}),
                 "disabled": ((), {"env": {"ZERO3_RECOMPUTE_DISABLE": "1"}})},
}


@functools.lru_cache(maxsize=None)
def _group_done(group: str):
    """Each run's outcome by name, or why the group has none: kept either way, so that a run past
    its timeout fails each test of its group once, not once a test."""
    runs = RUN_GROUPS[group]
    try:
        done = run_together([_doctor_run(*args, **settings) for args, settings in runs.values()], timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the doctor runs of group {group!r} ({', '.join(runs)}), started together: {type(exc).__name__}: {exc}"
    return dict(zip(runs, done))


def _doctor_of(group: str, name: str) -> subprocess.CompletedProcess:
    done = _group_done(group)
    if isinstance(done, str):
        pytest.fail(done, pytrace=False)
    return done[name]


ON_STOCK_CRASH = pytest.mark.skipif(KIND != "patch" or not recompute_keeps_frozen_tensors(),
                                    reason="the reproduction trains without the package here (deepspeed's own "
                                    "handling, or a torch whose checkpoint stores detached aliases)")
ON_DETACHING_TORCH = pytest.mark.skipif(KIND != "patch" or recompute_keeps_frozen_tensors(),
                                        reason="only on a torch whose checkpoint stores detached aliases (2.4)")


@pytest.mark.lane
@ON_STOCK_CRASH
def test_affected_and_fix_active():
    done = _doctor_of("stock_crashes", "fix_active")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stock       crashes: CheckpointError" in done.stdout
    assert "package     trains" in done.stdout
    assert "fix         active: patched, policy auto" in done.stdout
    assert "ZERO3_RECOMPUTE_DISABLE=1" in done.stdout, "it says how to turn the fix off"
    assert done.stdout.rstrip().endswith("verdict: affected, fix active")


@pytest.mark.lane
@ON_STOCK_CRASH
def test_affected_and_opted_out_exits_non_zero():
    done = _doctor_of("stock_crashes", "opted_out")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "stock       crashes: CheckpointError" in done.stdout
    assert "fix         NOT active: not-applied" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: affected, fix NOT active")


@pytest.mark.lane
@ON_STOCK_CRASH
def test_the_mechanism_in_use_is_named():
    done = _doctor_of("stock_crashes", "no_reproduce")
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(line.startswith("hooks       saved-tensors hooks read by ") for line in done.stdout.splitlines())
    assert "by torch    affected" in done.stdout


@ON_DETACHING_TORCH
def test_torch_24_is_not_affected_and_the_fix_is_active():
    """torch 2.4 stores a detached alias of every tensor: stock trains (leaking), the fix is on."""
    done = _doctor()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "by torch    not affected by the crash" in done.stdout
    assert "stock       trains" in done.stdout and "package     trains" in done.stdout
    assert "fix         active: patched, policy auto" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: not affected by the crash, fix active")


def _deepspeed_copy_with_changed(tmp_path, method: str) -> str:
    """A scratch copy of the installed deepspeed whose offload ``method`` takes one more
    (optional) argument: deepspeed still runs, the fingerprint no longer matches."""
    import shutil

    import deepspeed

    source = os.path.dirname(os.path.dirname(os.path.abspath(deepspeed.__file__)))
    copy = tmp_path / "deepspeed-copy"
    shutil.copytree(os.path.join(source, "deepspeed"), copy / "deepspeed",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    offload = copy / "deepspeed" / "runtime" / "zero" / "parameter_offload.py"
    text = offload.read_text()
    signature = f"def {method}(self, sub_module)"
    assert signature in text
    offload.write_text(text.replace(signature, f"def {method}(self, sub_module, changed=None)"))
    return str(copy)


@pytest.mark.lane
@pytest.mark.skipif(KIND == "unsupported", reason="deepspeed outside the supported range")
def test_a_refusal_is_named_with_what_works_and_exits_1_where_affected(tmp_path):
    """A changed target in a scratch copy of deepspeed: doctor names it, says what works, and
    exits 1 where stock crashes; the start-up hook warns once, in a process that imports deepspeed."""
    copy = _deepspeed_copy_with_changed(tmp_path, "post_sub_module_backward_function")
    clean = {name: value for name, value in os.environ.items() if not name.startswith("ZERO3_RECOMPUTE_")}
    done, imported = run_together([_doctor_run(env={"PYTHONPATH": copy}),
                                   ([sys.executable, "-c", "import deepspeed.runtime.zero.parameter_offload"],
                                    {**clean, "PYTHONPATH": copy})], timeout=600)
    target = ("DeepSpeedZeRoOffload.post_sub_module_backward_function changed: expected signature (self, sub_module), "
              "got (self, sub_module, changed)")
    assert "fix         NOT active: mismatch" in done.stdout, done.stdout + done.stderr
    assert "package     not run: the package refused to patch" in done.stdout
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused     ")]
    assert len(refused) == 1 and target in refused[0], "doctor names the refusal from its field"
    assert f"works with  {versions.working_pairings()}" in done.stdout
    assert "verdict: unknown" not in done.stdout
    affected = "stock       crashes: CheckpointError" in done.stdout
    assert affected == (KIND == "patch" and recompute_keeps_frozen_tensors()), done.stdout
    if affected:
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stdout.rstrip().endswith("verdict: affected, fix NOT active: the package refused to patch")
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.rstrip().endswith("verdict: not affected; the package refused to patch")
    assert imported.returncode == 0, imported.stderr
    warnings = [line for line in (imported.stdout + imported.stderr).splitlines() if line.startswith("zero3_recompute")]
    assert len(warnings) == 1 and target in warnings[0] and "works with torch" in warnings[0], warnings


@pytest.mark.skipif(KIND != "upstream", reason="only where deepspeed ships its own handling")
def test_upstream_deepspeed_taken_over_by_default():
    done = _doctor_of("upstream", "taken_over")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ships its own handling" in done.stdout
    assert "stock       trains" in done.stdout
    assert "fix         active: patched, policy auto" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: fix active, in place of deepspeed's own handling")


@pytest.mark.skipif(KIND != "upstream", reason="only where deepspeed ships its own handling")
@pytest.mark.parametrize("setting", ["policy_upstream", "disabled"])
def test_upstream_in_charge_names_its_gaps(setting):
    """Never "not affected" where the scenario matrix records crashes of deepspeed's own handling."""
    done = _doctor_of("upstream", setting)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fix         NOT active: upstream, policy upstream" in done.stdout
    assert "handling    deepspeed's own, in charge; it still crashes with " in done.stdout
    assert "non_reentrant_checkpoint" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: deepspeed's own handling in charge, with known gaps")


@pytest.mark.lane
def test_console_script_by_version_only():
    script = os.path.join(os.path.dirname(sys.executable), "zero3-recompute")
    if not os.path.exists(script):
        pytest.skip(f"no console script next to {sys.executable}: the package is not installed in this environment")
    done = _doctor("--no-reproduce", command=[script])
    expected = {"patch": (0, "verdict: affected, fix active" if recompute_keeps_frozen_tensors()
                          else "verdict: not affected by the crash, fix active"),
                "upstream": (0, "verdict: fix active, in place of deepspeed's own handling")}
    if KIND not in expected:
        pytest.skip(f"deepspeed {patch.deepspeed_version()} is outside the supported range")
    code, verdict = expected[KIND]
    assert (done.returncode, done.stdout.rstrip().splitlines()[-1]) == (code, verdict), done.stdout + done.stderr


class _Reproduction:
    """A stand-in for the reproduction's process: what it reports, or that it outlives its timeout."""

    def __init__(self, stdout: str = "", outlives_timeout: bool = False):
        self.stdout, self.outlives_timeout, self.killed, self.returncode = stdout, outlives_timeout, False, None

    def communicate(self, timeout=None):
        if self.outlives_timeout and not self.killed:
            raise subprocess.TimeoutExpired("reproduce", timeout)
        self.returncode = -9 if self.killed else 0
        return self.stdout, ""

    def poll(self):
        return self.returncode

    def kill(self):
        self.killed = True


@pytest.mark.once_per_run
def test_the_reproduction_starts_before_the_doctor_reads_torch(monkeypatch, capsys):
    """Their interpreters' start-up overlaps: the reproduction is under way while the doctor imports torch."""
    from zero3_recompute import doctor

    order = []
    report = {"accelerator": "cpu", "stock": {"outcome": "ok", "seconds": 1},
              "with_package": {"outcome": "ok", "seconds": 1},
              "status": {"mode": "patched", "active": True, "policy": "auto", "mechanism": None, "detail": "",
                         "switched_off": False}}
    monkeypatch.setattr(doctor, "_start_reproduction",
                        lambda: order.append("reproduction") or _Reproduction(json.dumps(report)))
    monkeypatch.setattr(doctor, "_torch_keeps_frozen_tensors", lambda: order.append("torch") or True)
    doctor.run()
    assert order == ["reproduction", "torch"]
    assert "stock       trains (1 s)" in capsys.readouterr().out


@pytest.mark.once_per_run
@pytest.mark.parametrize("where", ["past its timeout", "the probe raising"])
def test_a_reproduction_left_running_is_killed(monkeypatch, where):
    """Past its timeout the doctor names the failure; where the probe raises (Ctrl-C), it goes up."""
    from zero3_recompute import doctor

    reproduction = _Reproduction(outlives_timeout=True)
    monkeypatch.setattr(doctor, "_start_reproduction", lambda: reproduction)
    if where == "past its timeout":
        monkeypatch.setattr(doctor, "_torch_keeps_frozen_tensors", lambda: True)
        assert doctor._probe_and_reproduce(True) == (True, None, str(subprocess.TimeoutExpired(
            "reproduce", doctor.REPRODUCTION_TIMEOUT_S)))
    else:
        monkeypatch.setattr(doctor, "_torch_keeps_frozen_tensors", _interrupted)
        with pytest.raises(KeyboardInterrupt):
            doctor._probe_and_reproduce(True)
    assert reproduction.killed


def _interrupted():
    raise KeyboardInterrupt
