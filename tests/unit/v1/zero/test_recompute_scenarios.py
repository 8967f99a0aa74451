"""The scenario matrix: every scenario of scenarios.py on the installed deepspeed, 2 ranks, 3 steps.

test_with_package: loss and trainable grads match a plain-torch reference, nothing stays
gathered after any backward or step, and no rank hangs (the harness's timeout).
test_with_policy: the same under the keep and release policies, where the package replaces
deepspeed's own handling (0.19.3 on).
test_stock_behaviour: with the patch reverted, deepspeed still does what scenarios.py records
(crash, leak or ok; from 0.19.3, deepspeed's own handling), which is what docs/scenarios.md
tells users.
"""
import pytest

from tests.unit.common import DistributedTest
from tests.unit.patch_switch import upstream_installed
from tests.unit.v1.zero.scenarios import BY_NAME, SCENARIOS, expected_stock

NAMES = [scenario.name for scenario in SCENARIOS]
POLICIES_IN_PLACE_OF_UPSTREAM = ["keep", "release"] if upstream_installed() else [
    pytest.param("keep and release", marks=pytest.mark.skip(
        reason="the whole matrix runs under keep and release where the package replaces deepspeed's own handling "
        "(0.19.3 on); before, test_with_package (auto) and the random trees (each policy in turn) cover them"))
]


def _mode() -> str:
    import zero3_recompute

    return zero3_recompute.status().mode


@pytest.mark.scenario_matrix
class TestRecomputeScenarios(DistributedTest):
    world_size = 2
    timeout = 180

    @pytest.mark.parametrize("name", NAMES)
    def test_with_package(self, name):
        from tests.unit.v1.zero.procedures import run

        scenario = BY_NAME[name]
        if _mode() == "upstream" and scenario.upstream_fails:
            try:
                run(scenario)
            except Exception as exc:  # deepspeed's own handling, left in charge by policy 'upstream'
                pytest.xfail(f"{scenario.upstream_fails}: {type(exc).__name__}")
            raise AssertionError(f"deepspeed's own handling now passes {name}; update scenarios.py and the docs")
        run(scenario)

    @pytest.mark.parametrize("name", NAMES)
    @pytest.mark.parametrize("policy", POLICIES_IN_PLACE_OF_UPSTREAM)
    def test_with_policy(self, policy, name):
        """Where the package replaces deepspeed's own handling (0.19.3 on), the whole matrix
        trains under each policy, not only the default."""
        from tests.unit.patch_switch import policy_in_force
        from tests.unit.v1.zero.procedures import run

        with policy_in_force(policy):
            run(BY_NAME[name])

    @pytest.mark.parametrize("name", NAMES)
    def test_stock_behaviour(self, name):
        import deepspeed

        from tests.unit.v1.zero.procedures import observe_stock
        from zero3_recompute.versions import parse

        scenario = BY_NAME[name]
        if _mode() == "upstream":
            pytest.skip("policy 'upstream': test_with_package already ran deepspeed's own handling")
        reason = scenario.unavailable()
        if reason is not None:
            pytest.skip(reason)
        expected = expected_stock(scenario, parse(deepspeed.__version__), upstream_installed())
        observed = observe_stock(scenario)
        assert observed == expected, f"stock deepspeed {deepspeed.__version__}: expected {expected}, saw {observed}"
