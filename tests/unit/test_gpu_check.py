"""scripts/gpu_check.sh's dry mode on CPU: one gloo rank, tiny sizes, the script's own plumbing
(its environment, each check's command and summary line, the exit status)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.once_per_run
def test_dry_mode_runs_each_check_and_prints_one_line_each(tmp_path):
    """The matrix check is left out here: it is pytest over tests every pass already runs."""
    import deepspeed

    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "GPU_CHECK_CHECKS": "reproducer,fault,bench",
           "DS_VERSION": deepspeed.__version__}
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry"], env=env,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = done.stdout.splitlines()
    for name in ("reproducer", "fault", "bench"):
        found = [line for line in lines if line.startswith(("PASS ", "FAIL ")) and line.split()[1] == name]
        assert len(found) == 1 and found[0].startswith("PASS"), output
    assert any(line.startswith("PASS reproducer") and "loss went from" in line for line in lines), output
    assert any(line.startswith("PASS bench") and "step time ratios:" in line for line in lines), output
    assert lines[-1].startswith("gpu_check: 3 passed, 0 failed"), output
    assert (tmp_path / "bench" / "bench.json").exists()
