"""The scenario matrix: every scenario of scenarios.py on the installed deepspeed, 2 ranks, 3 steps.

test_with_package: loss and trainable grads match a plain-torch reference, nothing stays
gathered after any backward or step, and no rank hangs (the harness's timeout).
test_with_policy: the same under the keep and release policies, on every deepspeed.
test_stock_behaviour: with the patch reverted, deepspeed still does what scenarios.py records
(crash, leak or ok; from 0.19.3, deepspeed's own handling), which is what docs/scenarios.md
tells users.
"""
import pytest

from tests.unit.common import DistributedTest
from tests.unit.patch_switch import upstream_installed
from tests.unit.v1.zero.scenarios import BY_NAME, SCENARIOS, expected_stock

NAMES = [scenario.name for scenario in SCENARIOS]
# auto runs in test_with_package; the other two here, on every deepspeed.
OTHER_POLICIES = ["keep", "release"]


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
    @pytest.mark.parametrize("policy", OTHER_POLICIES)
    def test_with_policy(self, policy, name):
        """The whole matrix trains under each policy, not only the default."""
        from tests.unit.patch_switch import policy_in_force
        from tests.unit.v1.zero.procedures import run

        scenario = BY_NAME[name]
        reason = scenario.other_policies_unavailable()
        if reason is not None:
            pytest.skip(reason)
        with policy_in_force(policy):
            run(scenario)

    @pytest.mark.parametrize("name", NAMES)
    def test_stock_behaviour(self, name):
        import deepspeed

        from tests.unit.v1.zero.procedures import observe_stock
        from zero3_recompute.torch_recompute import recompute_keeps_frozen_tensors
        from zero3_recompute.versions import parse

        scenario = BY_NAME[name]
        if _mode() == "upstream":
            pytest.skip("policy 'upstream': test_with_package already ran deepspeed's own handling")
        reason = scenario.unavailable()
        if reason is not None:
            pytest.skip(reason)
        expected = expected_stock(scenario, parse(deepspeed.__version__), upstream_installed(),
                                  torch_keeps_frozen=recompute_keeps_frozen_tensors())
        observed = observe_stock(scenario)
        assert observed == expected, f"stock deepspeed {deepspeed.__version__}: expected {expected}, saw {observed}"
