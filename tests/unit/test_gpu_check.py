"""scripts/gpu_check.sh's dry mode on CPU: two gloo ranks, tiny sizes, the script's own plumbing
(its environment, each check's command, limit and summary line, the exit status)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = ("reproducer", "fault", "order", "bench")


@pytest.mark.once_per_run
def test_dry_mode_runs_each_check_and_prints_one_line_each(tmp_path):
    """The matrix, qlora and memcheck checks are left out here: pytest over tests that the
    passes of every deepspeed, or of the two-version lane, already run."""
    import deepspeed

    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "GPU_CHECK_CHECKS": ",".join(CHECKS),
           "DS_VERSION": deepspeed.__version__}
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry"], env=env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = done.stdout.splitlines()
    for name in CHECKS:
        found = [line for line in lines if line.startswith(("PASS ", "FAIL ")) and line.split()[1] == name]
        assert len(found) == 1 and found[0].startswith("PASS"), output
    assert any(line.startswith("PASS reproducer") and "loss went from" in line for line in lines), output
    assert any(line.startswith("PASS order") and "passed" in line for line in lines), output
    assert any(line.startswith("PASS bench") and "step time ratios:" in line for line in lines), output
    assert lines[-1].startswith(f"gpu_check: {len(CHECKS)} passed, 0 failed"), output
    assert (tmp_path / "bench" / "bench.json").exists()


@pytest.mark.once_per_run
def test_a_copy_other_than_the_checkout_is_refused_before_any_check(tmp_path):
    """The suite's conftest refuses any zero3_recompute but the checkout; on the first GPU run an
    installed copy failed every pytest check at once, each with its own opaque exit 4."""
    import shutil

    import deepspeed

    shutil.copytree(os.path.join(ROOT, "zero3_recompute"), tmp_path / "elsewhere" / "zero3_recompute")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "GPU_CHECK_CHECKS": "order",
           "DS_VERSION": deepspeed.__version__, "PYTHONPATH": str(tmp_path / "elsewhere")}
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"imports zero3_recompute from {tmp_path / 'elsewhere'}, expected this checkout" in done.stdout
    assert not [line for line in done.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))], done.stdout
