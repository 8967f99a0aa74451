"""Runs DistributedTest methods in their ranks instead of in the pytest process."""
import pytest

from tests.unit.common import DistributedTest, close_pools, run_distributed


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if isinstance(pyfuncitem.instance, DistributedTest):
        run_distributed(pyfuncitem)
        return True
    return None


def pytest_sessionfinish(session, exitstatus):
    close_pools()
