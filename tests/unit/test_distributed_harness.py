"""The DistributedTest harness itself: every failing rank reported, a hang turned into a failure,
a Ctrl-C answered with where each rank stood."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.unit import common
from tests.unit.common import DistributedTest, report, run_in_ranks

pytestmark = pytest.mark.once_per_run


class RankProbe(DistributedTest):
    """Not collected (no Test prefix): methods the harness tests run in the ranks."""

    @staticmethod
    def _rank():
        import torch.distributed

        return torch.distributed.get_rank()

    def passes(self):
        pass

    def fails_on_every_rank(self):
        raise ValueError(f"boom on rank {self._rank()}")

    def hangs_on_rank_1(self):
        if self._rank() == 1:
            time.sleep(3600)

    def dies_on_rank_1(self):
        if self._rank() == 1:
            os._exit(3)

    def skips(self):
        pytest.skip("nothing to check here")

    def waits_to_be_interrupted(self):
        """Starts a child, as deepspeed's JIT build of an op does; says its own pid and the child's
        in ZERO3_INTERRUPT_MARKERS/rank<N>, then sleeps (tests/unit/interrupted_run.py); a
        KeyboardInterrupt here leaves rank<N>.took_sigint."""
        path = os.path.join(os.environ["ZERO3_INTERRUPT_MARKERS"], f"rank{self._rank()}")
        child = subprocess.Popen(["sleep", "3600"])
        with open(path + ".tmp", "w") as handle:
            handle.write(f"{os.getpid()} {child.pid}")
        os.replace(path + ".tmp", path)
        try:
            time.sleep(3600)
        except KeyboardInterrupt:
            open(path + ".took_sigint", "w").close()
            raise


def _task(method):
    return {"module": __name__, "cls": "RankProbe", "method": method, "kwargs": {}}


def test_every_failing_rank_is_reported():
    results = run_in_ranks(_task("fails_on_every_rank"), 2, timeout=300)
    assert [result["outcome"] for result in results] == ["failed", "failed"]
    with pytest.raises(pytest.fail.Exception) as failure:
        report(results, "gloo")
    assert "boom on rank 0" in str(failure.value) and "boom on rank 1" in str(failure.value)


def test_hung_rank_fails_the_test_with_its_stack_and_the_pool_recovers():
    run_in_ranks(_task("passes"), 2, timeout=300)  # warm ranks, so the short timeout measures the hang
    results = run_in_ranks(_task("hangs_on_rank_1"), 2, timeout=10)
    assert results[0]["outcome"] == "passed"
    assert results[1]["outcome"] == "hung" and "hangs_on_rank_1" in results[1]["text"]
    with pytest.raises(pytest.fail.Exception, match="did not finish within 10 s"):
        report(results, "gloo")
    assert [result["outcome"] for result in run_in_ranks(_task("passes"), 2, timeout=300)] == ["passed", "passed"]


def test_a_rank_that_dies_fails_the_test_and_the_pool_recovers():
    results = run_in_ranks(_task("dies_on_rank_1"), 2, timeout=60)
    assert results[0]["outcome"] == "passed"
    assert results[1] == {"outcome": "died", "text": "rank 1 exited with code 3 before reporting"}
    assert [result["outcome"] for result in run_in_ranks(_task("passes"), 2, timeout=300)] == ["passed", "passed"]


def test_the_parent_wakes_on_the_ranks_word_not_a_poll(monkeypatch):
    """Each rank's word that its result is in ends the parent's wait: with the look for dead ranks
    put off past the runs' own timeout, a wait runs out only where no word came before that
    timeout (the run then reads the ranks' files once more, and counts the wait)."""
    run_in_ranks(_task("passes"), 2, timeout=300)  # the pool up, before the count starts
    monkeypatch.setattr(common, "_DEATH_CHECK_S", 3600.0)
    pool = common._pools[(2, common.choose_backend(2))]
    before = pool.waits_run_out
    for _ in range(3):  # words left over from the run before only send the parent round again
        assert [result["outcome"] for result in run_in_ranks(_task("passes"), 2, timeout=60)] == ["passed", "passed"]
    assert pool.waits_run_out == before


def test_skip_in_the_ranks_carries_through():
    results = run_in_ranks(_task("skips"), 2, timeout=300)
    with pytest.raises(pytest.skip.Exception, match="nothing to check here"):
        report(results, "gloo")


def _alive(pid: int) -> bool:
    """Whether the process runs: a zombie, dead but not yet reaped, is not alive."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_ctrl_c_prints_where_each_rank_stood_and_leaves_no_rank(tmp_path):
    """gpu_check stops a check at its limit as GNU timeout does: SIGINT to pytest, then to its
    process group. The ranks do nothing on it, while the programs they started stop as usual: the
    parent dumps each rank's stacks, kills the ranks at once (gpu_check kills what is left 15 s
    after its SIGINT) and pytest prints the stacks. The nested run first checks that pytest takes
    one Ctrl-C and ignores the next."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    markers, log = tmp_path / "markers", tmp_path / "pytest.log"
    markers.mkdir()
    with open(log, "w") as output:
        # SIGINT at its default in the nested run, even where this run was started with it ignored.
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                os.path.join("tests", "unit", "interrupted_run.py")],
                               cwd=root, env={**os.environ, "ZERO3_INTERRUPT_MARKERS": str(markers)},
                               stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: list = []
    try:
        deadline = time.monotonic() + 240
        while not all((markers / f"rank{rank}").exists() for rank in (0, 1)):
            assert run.poll() is None and time.monotonic() < deadline, \
                f"the ranks never started their task:\n{log.read_text()}"
            time.sleep(0.2)
        pids = [int(pid) for rank in (0, 1) for pid in (markers / f"rank{rank}").read_text().split()]
        os.kill(run.pid, signal.SIGINT)
        os.killpg(run.pid, signal.SIGINT)
        # Ends only once the parent has killed the ranks, which sleep until killed; the timeout
        # is a hang guard, far above the few seconds that takes.
        run.wait(timeout=300)
        survivors = [pid for pid in pids if _alive(pid)]
    finally:
        # Whatever is left of the run, ranks that outlived it included.
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.read_text()
    assert "KeyboardInterrupt" in text, text
    assert "1 passed" in text and "failed" not in text, text
    for rank in (0, 1):
        assert f"rank {rank} was running RankProbe.waits_to_be_interrupted when the run was interrupted" in text, text
        assert not (markers / f"rank{rank}.took_sigint").exists(), f"rank {rank} took the Ctrl-C itself:\n{text}"
    # Each rank's own stack, dumped where it slept.
    assert text.count("in waits_to_be_interrupted") >= 2, text
    # The ranks, killed, and their children, which the Ctrl-C stops as usual.
    assert not survivors, f"ranks or their children {survivors} of {pids} outlived the interrupted run:\n{text}"
