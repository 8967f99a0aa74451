"""The DistributedTest harness itself: every failing rank reported, a hang turned into a failure."""
import time

import pytest

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

    def skips(self):
        pytest.skip("nothing to check here")


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
    started = time.monotonic()
    results = run_in_ranks(_task("hangs_on_rank_1"), 2, timeout=10)
    assert time.monotonic() - started < 60
    assert results[0]["outcome"] == "passed"
    assert results[1]["outcome"] == "hung" and "hangs_on_rank_1" in results[1]["text"]
    with pytest.raises(pytest.fail.Exception, match="did not finish within 10 s"):
        report(results, "gloo")
    assert [result["outcome"] for result in run_in_ranks(_task("passes"), 2, timeout=300)] == ["passed", "passed"]


def test_skip_in_the_ranks_carries_through():
    results = run_in_ranks(_task("skips"), 2, timeout=300)
    with pytest.raises(pytest.skip.Exception, match="nothing to check here"):
        report(results, "gloo")
