"""ZeRO + activation checkpointing + frozen params: the core regression set.

Each test runs in 2 ranks (gloo on CPU, NCCL where there are enough GPUs). The package is
active the way a user gets it: its start-up hook, honouring ZERO3_RECOMPUTE_DISABLE.
"""
import pytest
import torch

from tests.unit.common import DistributedTest
from tests.unit.patch_switch import patch_reverted, policy_in_force, stock_crashes, upstream_installed, why_stock_trains
from tests.unit.v1.zero.frozen_models import (LR, MICRO_BATCH, build_model, global_batch, local_rows,
                                              trainable)
from tests.unit.v1.zero.scenario_runner import device as current_device
from tests.unit.v1.zero.scenario_runner import rank_and_world
from tests.unit.zero_state import GatherCounter, assert_all_released

STEPS = 3


def _config(zero_stage: int, **zero_overrides) -> dict:
    zero = {"stage": zero_stage, "stage3_param_persistence_threshold": 0}
    zero.update(zero_overrides)
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        # Explicit: deepspeed 0.19.8 changed the default from 0 to 1.0; the reference doesn't clip.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def _engine(model, config):
    import deepspeed

    optimizer = torch.optim.AdamW(trainable(model), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step_inputs(step: int, device):
    rank, world_size = rank_and_world()
    x, target = global_batch(step, world_size)
    x, target = x.to(device), target.to(device)
    # The block input needs grad, as after HF's enable_input_require_grads(); reentrant
    # checkpointing produces no parameter grads otherwise.
    return x, target, local_rows(x, rank).clone().requires_grad_(), local_rows(target, rank)


def _run_backward(engine, loss, backward_api: str) -> None:
    if backward_api == "engine":
        engine.backward(loss)
    else:
        loss.backward()


def _step(engine, zero_stage: int) -> None:
    if zero_stage == 3:
        engine.step()
        return
    # deepspeed 0.18.x's ZeRO-1/2 step all-gathers into views of a flat buffer that has a
    # grad_fn; torch 2.13's gloo refuses that under grad mode. Stock behaviour, not ours.
    with torch.no_grad():
        engine.step()


class TestZeroUserBackwardFrozenParamCheckpointing(DistributedTest):
    world_size = 2

    # Stages 1 and 2 never reach the patch (test_patch_activation.py's
    # test_stage_1_and_2_never_reach_the_patch): their reference runs are in the full tier.
    @pytest.mark.parametrize("zero_stage", [pytest.param(1, marks=pytest.mark.exhaustive),
                                            pytest.param(2, marks=pytest.mark.exhaustive), 3])
    @pytest.mark.parametrize("use_reentrant", [True, False])
    @pytest.mark.parametrize("backward_api", ["engine", "tensor"])
    def test_matches_reference(self, backward_api, use_reentrant, zero_stage):
        """Loss and trainable grads equal a plain-torch run; nothing stays gathered after backward."""
        from deepspeed.utils import safe_get_full_grad

        device = current_device()
        engine = _engine(build_model(use_reentrant), _config(zero_stage))
        if backward_api == "tensor" and not getattr(engine, "_support_torch_style_backward", False):
            pytest.skip("this deepspeed does not support loss.backward() in place of engine.backward() "
                        "(support came in 0.18); see test_plain_loss_backward_releases_everything")
        reference = build_model(use_reentrant).to(device)
        reference_optimizer = torch.optim.AdamW(trainable(reference), lr=LR)

        for step in range(STEPS):
            x, target, x_local, target_local = _step_inputs(step, device)
            loss = engine(x_local, target_local)
            _run_backward(engine, loss, backward_api)
            if zero_stage == 3:
                assert_all_released(engine.module, f"after backward of step {step}")
            grads = {name: safe_get_full_grad(param).detach().clone()
                     for name, param in engine.module.named_parameters() if param.requires_grad}

            reference_optimizer.zero_grad()
            expected_loss = reference(x_local.detach().clone().requires_grad_(), target_local)
            reference(x.clone().requires_grad_(), target).backward()
            torch.testing.assert_close(loss.detach(), expected_loss.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step} loss: {m}")
            for name, param in reference.named_parameters():
                if param.requires_grad:
                    torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"step {step} grad of {name}: {m}")

            _step(engine, zero_stage)
            reference_optimizer.step()
            if zero_stage == 3:
                assert_all_released(engine.module, f"after step {step}")

    @pytest.mark.parametrize("use_reentrant", [True, False])
    def test_plain_loss_backward_releases_everything(self, use_reentrant):
        """The end-of-backward release does not depend on engine.backward, on any deepspeed."""
        device = current_device()
        engine = _engine(build_model(use_reentrant), _config(3))
        reference = build_model(use_reentrant).to(device)
        _, _, x_local, target_local = _step_inputs(0, device)
        loss = engine(x_local, target_local)
        loss.backward()
        assert_all_released(engine.module, "after loss.backward()")
        expected = reference(x_local.detach().clone().requires_grad_(), target_local)
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("policy", ["auto", "keep", "release"])
    @pytest.mark.parametrize("use_reentrant", [True, False])
    def test_frozen_param_gathers_per_step(self, use_reentrant, policy):
        """All-gathers per frozen param per step: 2 where a recompute's gather is kept for the
        module's own backward (the minimum), 3 where it is released; trainable params exactly
        as stock. auto keeps under non-reentrant checkpointing; under reentrant it releases as
        stock does, or keeps where it replaces deepspeed's own handling, which kept there, or
        where nothing reads the saved-tensors hook stack (torch < 2.8 with the hook_stack layer
        off: NOTE [ Reading the saved-tensors hook stack ], rule 5)."""
        import zero3_recompute
        from zero3_recompute.targets import NO_READER

        status = zero3_recompute.status()
        if status.mode == "upstream":
            pytest.skip(f"deepspeed's own handling is in charge: {status}")
        auto_reentrant = 2 if upstream_installed() or status.mechanism == NO_READER else 3
        expected = {"auto": auto_reentrant if use_reentrant else 2, "keep": 2, "release": 3}[policy]
        with policy_in_force(policy):
            counts = self._gathers_per_step(use_reentrant)
        frozen = [name for name, requires_grad in counts["kinds"].items() if not requires_grad]
        for step, per_param in enumerate(counts["steps"]):
            ours = {name: per_param[name] for name in frozen}
            assert ours == {name: expected for name in frozen}, \
                f"policy {policy}, step {step}: all-gathers per frozen param: {ours}"
        if not use_reentrant and upstream_installed():
            # deepspeed's own handling trains here: it gathers frozen params 3 times per step.
            with patch_reverted():
                upstream = self._gathers_per_step(use_reentrant)
            for step, per_param in enumerate(upstream["steps"]):
                theirs = {name: per_param[name] for name in frozen}
                assert theirs == {name: 3 for name in frozen}, f"deepspeed's own, step {step}: frozen {theirs}"
        if use_reentrant:
            # Stock deepspeed trains here too: it gathers frozen params 3 times (deepspeed's own
            # handling, 0.19.3 on: twice), trainable ones exactly as often as with the patch.
            with patch_reverted():
                stock = self._gathers_per_step(use_reentrant)
            stock_gathers = 2 if upstream_installed() else 3
            trainable_names = [name for name in counts["kinds"] if name not in frozen]
            for step, (ours, theirs) in enumerate(zip(counts["steps"], stock["steps"])):
                stock_frozen = {name: theirs[name] for name in frozen}
                assert stock_frozen == {name: stock_gathers for name in frozen}, \
                    f"stock step {step}: frozen {stock_frozen}"
                ours_trainable = {name: ours[name] for name in trainable_names}
                stock_trainable = {name: theirs[name] for name in trainable_names}
                assert ours_trainable == stock_trainable, \
                    f"step {step}: trainable all-gathers {ours_trainable}, stock {stock_trainable}"

    def _gathers_per_step(self, use_reentrant):
        device = current_device()
        engine = _engine(build_model(use_reentrant),
                         _config(3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0))
        counter = GatherCounter(engine.module)
        steps = []
        try:
            for step in range(STEPS):
                _, _, x_local, target_local = _step_inputs(step, device)
                engine.backward(engine(x_local, target_local))
                engine.step()
                assert_all_released(engine.module, f"after step {step}")
                steps.append(counter.take())
        finally:
            counter.close()
        return {"steps": steps, "kinds": {name: p.requires_grad for name, p in engine.module.named_parameters()}}

    def test_canary_stock_crashes_without_patch(self):
        """Without the patch, deepspeed 0.14.5-0.19.2 crash here: the suite can see the bug."""
        import zero3_recompute
        from torch.utils.checkpoint import CheckpointError

        if not stock_crashes():
            pytest.skip(f"{why_stock_trains()}: {zero3_recompute.status()}")
        with patch_reverted():
            engine = _engine(build_model(use_reentrant=False), _config(3))
            _, _, x_local, target_local = _step_inputs(0, current_device())
            loss = engine(x_local, target_local)
            with pytest.raises(CheckpointError, match="metadata"):
                engine.backward(loss)
