"""Runs DistributedTest methods in their ranks instead of in the pytest process, and refuses to
test any zero3_recompute but the checkout this file belongs to."""
import os
import signal
import sys
import threading

import pytest

import zero3_recompute

from tests.unit.common import DistributedTest, account_of_interrupted_ranks, close_pools, run_distributed


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    imported = os.path.dirname(os.path.dirname(os.path.abspath(zero3_recompute.__file__)))
    if os.path.realpath(imported) != os.path.realpath(CHECKOUT):
        raise pytest.UsageError(f"zero3_recompute was imported from {imported}, expected this checkout {CHECKOUT}: the "
                                "start-up hook loads the installed copy first, so the tests would run stale code. "
                                "Install the checkout in editable mode: pip install --no-deps -e .")
    # Only where Python's own handler is installed: not in a run started with SIGINT ignored, nor
    # over a handler of somebody else's.
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)


def pytest_collection_modifyitems(config, items):
    """The two-version lane (tests/unit/lanes.py): its tests are deselected outside it."""
    from tests.unit.lanes import outside_lane

    kept, left_out = [], []
    for item in items:
        (left_out if outside_lane(item) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def environment_in_report(record_testsuite_property):
    """The torch and Python of this pass, in the JUnit report (the support and scenario tables
    read them): which torch, and whether its checkpoint keeps the very frozen tensors the
    recompute saved (torch_recompute), which decides what stock deepspeed does."""
    import platform

    import torch

    from zero3_recompute.torch_recompute import recompute_keeps_frozen_tensors

    record_testsuite_property("torch", torch.__version__.split("+")[0])
    record_testsuite_property("python", platform.python_version())
    record_testsuite_property("torch_keeps_frozen", str(recompute_keeps_frozen_tensors()).lower())
    # What the start-up hook made of this deepspeed, as status() fields (the support table's
    # "with zero3-recompute" column): the hook patches when this module is imported.
    import importlib

    importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    found = zero3_recompute.status()
    record_testsuite_property("patch_mode", found.mode)
    record_testsuite_property("switched_off", ",".join(found.switched_off))
    record_testsuite_property("layers", ",".join(found.layers))
    # Whether this deepspeed's code has deepspeed #8072 (NOTE [ Mixed-dtype gathers ]), patched or not.
    from zero3_recompute.targets import mixed_dtype_gather

    record_testsuite_property("mixed_dtype_gather_needed", str(mixed_dtype_gather().needed).lower())


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if isinstance(pyfuncitem.instance, DistributedTest):
        run_distributed(pyfuncitem)
        return True
    return None


def pytest_sessionfinish(session, exitstatus):
    close_pools()


def _interrupt_once(signum, frame) -> None:
    """pytest's SIGINT handler: the first Ctrl-C interrupts the run, later ones are ignored, so
    that the ranks' account (pytest_keyboard_interrupt) is written whole. GNU timeout's SIGINT
    reaches pytest twice, to it and then to its process group, and a second KeyboardInterrupt in
    pytest's own handling of the first would skip that account."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def pytest_keyboard_interrupt(excinfo):
    """Where each rank stood when a Ctrl-C (gpu_check's limit) stopped the run; the ranks do
    nothing on the Ctrl-C, so their stacks are those of the work they were doing. Printed here,
    since pytest drops an interrupted test's captured output."""
    for text in account_of_interrupted_ranks():
        print(text, file=sys.stderr)
