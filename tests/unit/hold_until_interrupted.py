"""A pytest plugin, not a test module: ``-p tests.unit.hold_until_interrupted`` holds the run at
its start until a SIGINT ends it. test_gpu_check puts it in a check's pytest (PYTEST_ADDOPTS),
so that the check is still running at its limit however fast the machine is."""
import signal


def pytest_sessionstart(session):
    while True:
        signal.pause()  # Python's SIGINT handler raises KeyboardInterrupt out of here
