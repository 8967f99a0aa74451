"""Randomized differential test: seeded random module trees, ZeRO-3 with the package vs plain torch.

Each tree trains 2 steps on 2 ranks; per micro-batch the loss, per step every trainable grad,
must match the reference, and after every backward and step nothing may stay gathered.

    ZERO3_TREES=300 ...        run seeds 0..299 instead of the default 30
    ZERO3_TREE_SEEDS=17,42 ... run exactly these seeds (what a failure prints)
"""
import os

import pytest

from tests.unit.common import DistributedTest

DEFAULT_TREES = 30
STEPS = 2


def _seeds():
    explicit = os.environ.get("ZERO3_TREE_SEEDS")
    if explicit:
        return [int(seed) for seed in explicit.split(",") if seed.strip()]
    return list(range(int(os.environ.get("ZERO3_TREES", DEFAULT_TREES))))


def _reproduce(seed: int) -> str:
    return (f"ZERO3_TREE_SEEDS={seed} PYTHONPATH=.deepspeed/<deepspeed version> "
            f".venv/bin/python -m pytest tests/unit/v1/zero/test_random_trees.py")


@pytest.mark.random_trees
class TestRandomTreesRecompute(DistributedTest):
    world_size = 2
    timeout = 120

    @pytest.mark.parametrize("seed", _seeds())
    def test_tree_matches_reference(self, seed):
        import torch

        from tests.unit.v1.zero.random_trees import DIM, case, supported_dtypes
        from tests.unit.v1.zero.scenario_runner import Run, base_config, make_batch, merge

        tree_case = case(seed, supported_dtypes())
        precision = {torch.bfloat16: {"bf16": {"enabled": True}},
                     torch.float16: {"fp16": {"enabled": True, "initial_scale_power": 8}}}.get(tree_case.dtype, {})
        try:
            run = Run(tree_case.build, merge(base_config(), precision), tree_case.dtype)
            run.train(STEPS, lambda step, micro: make_batch(step, micro, False, tree_case.input_grad, DIM, 0))
        except Exception as exc:
            raise AssertionError(f"{type(exc).__name__}: {exc}\n\n{tree_case.describe()}\n\n"
                                 f"reproduce: {_reproduce(seed)}") from exc
