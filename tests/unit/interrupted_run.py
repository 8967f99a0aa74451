"""Not collected (no test_ prefix): test_distributed_harness runs this file in a pytest of its own
and interrupts it with SIGINT while its ranks sleep."""
from tests.unit.common import run_in_ranks


def test_waits_in_its_ranks_until_interrupted():
    task = {"module": "tests.unit.test_distributed_harness", "cls": "RankProbe",
            "method": "waits_to_be_interrupted", "kwargs": {}}
    run_in_ranks(task, 2, timeout=300)
