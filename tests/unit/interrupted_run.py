"""Not collected (no test_ prefix): test_distributed_harness runs this file in a pytest of its own
and interrupts it with SIGINT while its ranks sleep."""
import signal

import pytest

from tests.conftest import _interrupt_once
from tests.unit.common import run_in_ranks


def test_a_ctrl_c_after_the_first_is_ignored():
    """Before the ranks start: conftest's handler is pytest's (the run was started with SIGINT at
    its default), the first SIGINT interrupts and the next is ignored; then the handler is put back."""
    assert signal.getsignal(signal.SIGINT) is _interrupt_once
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # a KeyboardInterrupt here would end the whole run
    finally:
        signal.signal(signal.SIGINT, _interrupt_once)


def test_waits_in_its_ranks_until_interrupted():
    task = {"module": "tests.unit.test_distributed_harness", "cls": "RankProbe",
            "method": "waits_to_be_interrupted", "kwargs": {}}
    run_in_ranks(task, 2, timeout=300)
