"""scripts/gpu_check.sh's dry mode on CPU: two gloo ranks, tiny sizes, the script's own plumbing
(its environment, each check's command, limit and summary line, the exit status)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dry_run(out, checks: str, timeout: int, **env: str) -> subprocess.CompletedProcess:
    """gpu_check.sh --dry with this interpreter and deepspeed, its logs under ``out``; ``env`` adds
    to the environment."""
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_CHECKS": checks, **env}
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry"], env=env,
                          capture_output=True, text=True, timeout=timeout)


# In dry mode each check's limit is a hang guard: on a loaded 2-core machine the order check
# alone took 30 s, its GPU limit.
DRY_LIMITS = ",".join(f"{check}=900" for check in ("reproducer", "fault", "order", "bench"))


@pytest.mark.once_per_run
@pytest.mark.parametrize("checks", [
    ("reproducer", "order"),
    pytest.param(("fault", "bench"), marks=pytest.mark.exhaustive),
], ids=lambda checks: "-".join(checks))
def test_dry_mode_runs_each_check_and_prints_one_line_each(tmp_path, checks):
    """The matrix, qlora and memcheck checks are left out here: pytest over tests that every
    deepspeed's cell, or the two-version lane, already runs. The ci tier runs one check of each
    kind (a script, a pytest); the full tier fault's selection and the bench's summary line."""
    done = _dry_run(tmp_path, ",".join(checks), timeout=3600, GPU_CHECK_LIMITS=DRY_LIMITS)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = done.stdout.splitlines()
    for name in checks:
        found = [line for line in lines if line.startswith(("PASS ", "FAIL ")) and line.split()[1] == name]
        assert len(found) == 1 and found[0].startswith("PASS"), output
    if "reproducer" in checks:
        assert any(line.startswith("PASS reproducer") and "loss went from" in line for line in lines), output
    if "order" in checks:
        assert any(line.startswith("PASS order") and "passed" in line for line in lines), output
    if "bench" in checks:
        assert any(line.startswith("PASS bench") and "step time ratios:" in line for line in lines), output
        assert (tmp_path / "bench" / "bench.json").exists()
    assert lines[-1].startswith(f"gpu_check: {len(checks)} passed, 0 failed"), output


@pytest.mark.once_per_run
def test_a_copy_other_than_the_checkout_is_refused_before_any_check(tmp_path):
    """The suite's conftest refuses any zero3_recompute but the checkout; on the first GPU run an
    installed copy failed every pytest check at once, each with its own opaque exit 4."""
    import shutil

    shutil.copytree(os.path.join(ROOT, "zero3_recompute"), tmp_path / "elsewhere" / "zero3_recompute")
    done = _dry_run(tmp_path / "out", "order", timeout=300, PYTHONPATH=str(tmp_path / "elsewhere"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"imports zero3_recompute from {tmp_path / 'elsewhere'}, expected this checkout" in done.stdout
    assert not [line for line in done.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))], done.stdout


@pytest.mark.once_per_run
def test_a_check_stopped_at_its_limit_leaves_pytests_account_in_its_log(tmp_path):
    """On the first GPU run, fault and order went over their limits with empty logs: SIGTERM
    stopped pytest before it flushed a line. At its limit a check now gets SIGINT, and pytest
    writes where it stood. The check's pytest is held at its start until interrupted
    (hold_until_interrupted.py), so it is still running at its limit on any machine. What pytest
    then prints of the ranks is test_distributed_harness's
    test_a_ctrl_c_prints_where_each_rank_stood_and_leaves_no_rank."""
    done = _dry_run(tmp_path, "order", timeout=120, GPU_CHECK_LIMITS="order=5",
                    PYTEST_ADDOPTS="-p tests.unit.hold_until_interrupted")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert any(line.startswith("FAIL order") and "over its 5 s limit" in line for line in done.stdout.splitlines()), \
        output
    assert "KeyboardInterrupt" in (tmp_path / "order.log").read_text(), output


@pytest.mark.once_per_run
@pytest.mark.parametrize("limits, said", [
    ("orders=5", "takes check=seconds pairs, the checks being"),
    ("order=five", "got 'order=five'"),
    ("=5", "got '=5'"),
    ("order=5,bench=29", "gives the bench 29 s; it needs 30 s or more"),
])
def test_a_limit_that_names_no_check_or_no_seconds_is_refused(tmp_path, limits, said):
    """Refused before anything is imported; the bench's limit must leave room for its own timeout."""
    done = _dry_run(tmp_path, "order", timeout=120, GPU_CHECK_LIMITS=limits)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("gpu_check: GPU_CHECK_LIMITS ") and said in done.stdout, done.stdout
    assert not [line for line in done.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))], done.stdout
