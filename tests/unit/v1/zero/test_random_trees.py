"""Randomized differential test: seeded random module trees, ZeRO-3 with the package vs plain torch.

Each tree trains 2 steps on 2 ranks; per micro-batch the loss, per step every trainable grad,
must match the reference, and after every step nothing may stay gathered, nor after every
backward of a tree that runs a checkpoint (one that runs none takes stock's path). The
reference is plain torch for fp32 trees. A bf16/fp16 tree is compared with the same tree under
ZeRO-2, which the package does not touch: same precision, same per-rank reduction, so a
difference is ours and not rounding (against fp32, rounding alone reaches 20% on deep trees).

Each seed runs under one release policy, in turn auto, keep, release (seed % 3), so the 30
trees of a run cover each policy with 10.

    ZERO3_TREES=300 ...        run seeds 0..299 instead of the default 30
    ZERO3_TREE_SEEDS=17,42 ... run exactly these seeds (what a failure prints)
    ZERO3_TREE_POLICY=keep ... run every seed under one policy
"""
import os

import pytest

from tests.unit.common import DistributedTest

DEFAULT_TREES = 30
STEPS = 2
POLICIES = ("auto", "keep", "release")


def _seeds():
    explicit = os.environ.get("ZERO3_TREE_SEEDS")
    if explicit:
        return [int(seed) for seed in explicit.split(",") if seed.strip()]
    return list(range(int(os.environ.get("ZERO3_TREES", DEFAULT_TREES))))


def policy_for(seed: int) -> str:
    return os.environ.get("ZERO3_TREE_POLICY") or POLICIES[seed % len(POLICIES)]


def _reproduce(seed: int) -> str:
    return (f"ZERO3_TREE_SEEDS={seed} ZERO3_TREE_POLICY={policy_for(seed)} bash scripts/nox.sh "
            f"-s 'fast(torch-2.13.0-deepspeed-0.19.2)' -- tests/unit/v1/zero/test_random_trees.py (or that deepspeed's cell)")


def train_against(run, zero2, steps, batch) -> None:
    """Step ``run`` (ZeRO-3) and ``zero2`` on the same batches; losses and grads must agree."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    from tests.unit.v1.zero.scenario_runner import Mismatch, Tolerance, local_rows
    from tests.unit.zero_state import assert_all_released

    # Element-wise: both sides round alike, only the order of the cross-rank reduction differs.
    tolerance = Tolerance(torch.float32, rtol=1e-2, atol=1e-3)
    for step in range(steps):
        inputs, target = batch(step, 0)
        losses = []
        for each in (run, zero2):
            loss = each.engine(local_rows(inputs).detach().to(each.device, each.dtype).requires_grad_(
                inputs.requires_grad), local_rows(target).to(each.device, each.dtype))
            each.engine.backward(loss)
            losses.append(loss.detach())
        if run.released_after_backward:
            assert_all_released(run.module, f"after backward of step {step}")
        tolerance.check(losses[0], losses[1], f"step {step} loss, ZeRO-3 vs ZeRO-2")
        for (name, ours), theirs in zip(run.module.named_parameters(), zero2.module.parameters()):
            if ours.requires_grad:
                mine, other = safe_get_full_grad(ours), safe_get_full_grad(theirs)
                if (mine is None) != (other is None):
                    raise Mismatch(f"step {step} grad of {name}: ZeRO-3 {mine is not None}, ZeRO-2 {other is not None}")
                if mine is not None:
                    tolerance.check(mine, other, f"step {step} grad of {name}, ZeRO-3 vs ZeRO-2")
        run.engine.step()
        with torch.no_grad():  # deepspeed 0.18.x's ZeRO-1/2 step fails on gloo under grad mode
            zero2.engine.step()
        assert_all_released(run.module, f"after step {step}")


@pytest.mark.random_trees
class TestRandomTreesRecompute(DistributedTest):
    world_size = 2
    timeout = 120

    @pytest.mark.parametrize("seed", _seeds())
    @pytest.mark.parametrize("prefetch", ["exact", "deepspeed"])
    def test_tree_matches_reference(self, prefetch, seed):
        """``exact``: prefetch and reuse off (base_config); ``deepspeed``: deepspeed's defaults
        (scenario_runner.DEEPSPEED_PREFETCH), on the versions that runs on."""
        import torch

        from tests.unit.patch_switch import policy_in_force
        from tests.unit.v1.zero.random_trees import DIM, case, supported_dtypes
        from tests.unit.v1.zero.scenario_runner import DEEPSPEED_PREFETCH, deepspeed_prefetch_skipped, make_batch

        if prefetch == "deepspeed":
            skipped = deepspeed_prefetch_skipped()
            if skipped is not None:
                pytest.skip(skipped)
            precision_zero = {"zero_optimization": DEEPSPEED_PREFETCH}
        else:
            precision_zero = {}
        tree_case = case(seed, supported_dtypes())
        precision = {torch.bfloat16: {"bf16": {"enabled": True}},
                     torch.float16: {"fp16": {"enabled": True, "initial_scale_power": 8}}}.get(tree_case.dtype, {})
        precision = dict(precision, **precision_zero)
        batch = lambda step, micro: make_batch(step, micro, False, tree_case.input_grad, DIM, 0)  # noqa: E731
        try:
            with policy_in_force(policy_for(seed)):
                self._train(tree_case, precision, batch)
        except Exception as exc:
            raise AssertionError(f"{type(exc).__name__}: {exc}\n\npolicy {policy_for(seed)}\n{tree_case.describe()}\n\n"
                                 f"reproduce: {_reproduce(seed)}") from exc

    @staticmethod
    def _train(tree_case, precision, batch) -> None:
        import torch

        from tests.unit.v1.zero.scenario_runner import Run, base_config, merge

        run = Run(tree_case.build, merge(base_config(), precision), tree_case.dtype,
                  released_after_backward=tree_case.checkpointed)
        if tree_case.dtype == torch.float32:
            run.train(STEPS, batch)
        else:
            zero2 = Run(tree_case.build, merge(base_config(), dict(precision, zero_optimization={"stage": 2})),
                        tree_case.dtype)
            train_against(run, zero2, STEPS, batch)
