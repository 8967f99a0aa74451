"""ZeRO++ hierarchical partitioning (hpZ) below world size, 4 ranks: zero_hpz_partition_size 2 keeps
a secondary copy of each param's partition within each pair of ranks, and the backward fetch
gathers from it (forward=False), then releases it as the forward's release does the primary.

A checkpointed LoRA-like chain (frozen norm and linear, a trainable linear per block, non-reentrant,
deepspeed's default prefetch and reuse distance) trains as the plain-torch reference trains, with
nothing gathered after any backward or step (procedures' "train"), and hpZ is really in force: each
partitioned param has its secondary partition, of world size / 2 the primary's numel. On 0.14.5-0.19.2
stock crashes here (ZERO3_RECOMPUTE_DISABLE=1 shows it).

Mutation: HoldLedger.before_recompute_release returning no plan fails it with CheckpointError.
"""
import pytest

from tests.unit.common import DistributedTest

WORLD_SIZE = 4
HPZ = 2


def _scenario():
    from tests.unit.v1.zero import scenarios
    from tests.unit.v1.zero.scenarios import NON_REENTRANT, Scenario, chain

    return Scenario("hpz_below_world_size", "ZeRO-3 knobs",
                    f"ZeRO++ hpZ: zero_hpz_partition_size {HPZ} of {WORLD_SIZE} ranks, deepspeed's default prefetch",
                    chain(NON_REENTRANT, count=3),
                    zero={"zero_hpz_partition_size": HPZ, "stage3_prefetch_bucket_size": 50_000_000,
                          "stage3_max_reuse_distance": 1_000_000_000}, stock=scenarios.crash_until_upstream)


def _assert_secondary_partitions(run_) -> None:
    from tests.unit.zero_state import zero3_params

    params = [param for param in zero3_params(run_.module) if not param.ds_persist]
    assert params, "nothing is partitioned"
    for param in params:
        secondary = getattr(param, "ds_secondary_tensor", None)
        assert secondary is not None, f"ds_id={param.ds_id}: no secondary partition: hpZ is not in force"
        assert secondary.numel() == param.ds_tensor.numel() * WORLD_SIZE // HPZ, \
            f"ds_id={param.ds_id}: secondary partition of {secondary.numel()} numel, primary {param.ds_tensor.numel()}"


@pytest.mark.lane
class TestHpzBelowWorldSize(DistributedTest):
    world_size = WORLD_SIZE
    timeout = 300

    def test_trains_as_reference_with_nothing_gathered(self):
        from tests.unit.v1.zero.procedures import PROCEDURES, start

        scenario = _scenario()
        run_ = start(scenario)
        _assert_secondary_partitions(run_)
        PROCEDURES[scenario.procedure](scenario, run_)
