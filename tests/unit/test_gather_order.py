"""The cross-rank check of all-gather order (tests/unit/gather_order.py), on 2 ranks.

The mutation it must catch: one rank gathers two same-sized params in the other order. The
collectives pair up (same sizes), nothing raises, and that rank's params get each other's shards;
the check names the step and gather where the ranks part. Then a plain training step, the same on
both ranks, gives no divergence.
"""
import pytest
import torch
import torch.nn as nn

from tests.unit.common import DistributedTest

DIM = 8


def _partitioned_pair():
    import deepspeed

    from tests.unit.v1.zero.scenario_runner import base_config

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=base_config()):
        first, second = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
    with deepspeed.zero.GatheredParameters([first.weight, second.weight], modifier_rank=0), torch.no_grad():
        first.weight.fill_(1.0)
        second.weight.fill_(2.0)
    return first.weight, second.weight


class TestGatherOrderCheck(DistributedTest):
    world_size = 2
    timeout = 120

    def test_catches_a_swap_on_one_rank(self):
        import deepspeed.comm as dist

        from tests.unit import gather_order

        first, second = _partitioned_pair()
        gather_order.take()
        order = [first, second] if dist.get_rank() == 0 else [second, first]  # the mutation
        # deepspeed's list gather, as GatheredParameters calls it (which sorts its params first).
        first.all_gather(param_list=order)
        seen = (first.detach().clone(), second.detach().clone())
        first.partition(param_list=order)
        diverged = gather_order.compare_across_ranks()
        gather_order.take()  # the harness's own check would fail this test too: it has been made here
        assert diverged is not None, "one rank gathered two params in the other order, and the check saw nothing"
        assert "step 0, gather 0" in diverged and f"[{first.ds_id}, {second.ds_id}]" in diverged \
            and f"[{second.ds_id}, {first.ds_id}]" in diverged, diverged
        if dist.get_rank() == 1:
            # What the swap does unseen: shards land in the wrong param, and nothing raises.
            assert not torch.equal(seen[0], torch.ones_like(seen[0])), "the swap left the values right"

    def test_same_order_is_no_divergence(self):
        import deepspeed

        from tests.unit import gather_order

        first, second = _partitioned_pair()
        gather_order.take()
        with deepspeed.zero.GatheredParameters([first, second]):
            pass
        assert gather_order.compare_across_ranks() is None


def test_first_divergence_names_the_first_difference():
    from tests.unit.gather_order import first_divergence

    assert first_divergence([[[(1, 2), (3, )]], [[(1, 2), (3, )]]]) is None
    found = first_divergence([[[(1, 2)], [(3, ), (4, )]], [[(1, 2)], [(3, ), (5, )]]])
    assert found.startswith("ranks 0 and 1 all-gather differently at step 1, gather 1 of 2 / 2"), found
    assert "rank 0 ds_ids [4], rank 1 ds_ids [5]" in found, found
    missing = first_divergence([[[(1, )], [(2, )]], [[(1, )]]])
    assert "step 1, gather 0" in missing and "nothing" in missing, missing


@pytest.mark.parametrize("records", [[[], []], [[[(1, )]]]])
def test_no_divergence_in_one_record_or_empty(records):
    from tests.unit.gather_order import first_divergence

    assert first_divergence(records) is None
