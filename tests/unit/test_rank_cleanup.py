"""Between tests, the ranks free the engines of the test that ended (drop_finished_engines in
zero3_recompute/testing/teardown.py, which the benchmark runs between depths): they outlived
it, and on a GPU their buffers filled the device within one scenario file. Runs on every
deepspeed, since what keeps an engine alive differs between them (on 0.14.5 no one step of the
clean-up is needed alone)."""
import weakref

import torch

from tests.unit.common import DistributedTest, run_in_ranks
from tests.unit.v1.zero.scenario_models import DIM, Chain, pair, torch_checkpoint


class EngineProbe(DistributedTest):
    """Not collected (no Test prefix): the two halves of the test, one task each in the same ranks."""

    def trains_a_checkpointed_engine(self):
        """Two ZeRO-3 steps under non-reentrant checkpointing, torch's early stop on; the engine
        is dropped when the test returns, as a test's engine is."""
        import deepspeed

        torch.manual_seed(0)
        model = Chain([pair(), pair()], torch_checkpoint(use_reentrant=False))
        optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=0.1)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for _ in range(2):  # the second step replays deepspeed's trace, and so fills its release cache
            engine.backward(engine(torch.randn(2, DIM, requires_grad=True), torch.randn(2, DIM)))
            engine.step()
        _FINISHED.append(weakref.ref(engine))

    def finds_the_last_engine_collected(self):
        assert _FINISHED, "trains_a_checkpointed_engine did not run in this rank before"
        assert _FINISHED[-1]() is None, "the engine of the previous test is still alive in the rank"


_FINISHED = []  # weak references to the engines trains_a_checkpointed_engine made, in this rank


def test_a_finished_tests_engine_is_freed_before_the_next_test():
    for method in ("trains_a_checkpointed_engine", "finds_the_last_engine_collected"):
        task = {"module": __name__, "cls": "EngineProbe", "method": method, "kwargs": {}}
        results = run_in_ranks(task, 2, timeout=300)
        assert [result["outcome"] for result in results] == ["passed", "passed"], results
