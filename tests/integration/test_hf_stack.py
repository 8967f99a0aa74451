"""The HF stack end to end, 2 ranks: transformers' Trainer and TRL's SFTTrainer on a PEFT LoRA
Llama under ZeRO-3, as users run them, with the package active the way pip install leaves it.

Select with ``-m hf``, skip with ``-m "not hf"``. Each run's logged loss per step, and how far
each LoRA param moved under SGD (its gradients, summed over the steps), must match a plain-torch
reference on the same batches (hf_runs.py), and after training no non-persistent ZeRO-3 param
may stay gathered.
"""
import pytest

from tests.unit.common import DistributedTest
from tests.unit.patch_switch import patch_reverted, stock_crashes, why_stock_trains

LOSS_TOLERANCE = 2e-3  # the Trainer logs losses rounded to 4 decimals


def _check(trainer, recorder, input_require_grads: bool, use_reentrant: bool) -> None:
    import torch

    from tests.integration.hf_runs import (STEPS, assert_moved_as_reference, checkpoint_modes, gather_batches,
                                           logged_losses, reference_run, trainable_values)
    from tests.unit.zero_state import assert_all_released, zero3_params

    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    assert zero3_params(model), "the Trainer did not put the model under ZeRO-3"
    assert checkpoint_modes(model) == {use_reentrant}, \
        f"trained with use_reentrant {checkpoint_modes(model)}, expected {use_reentrant}"
    assert_all_released(model, "after training")
    losses = logged_losses(trainer)
    assert len(losses) == STEPS, f"expected {STEPS} logged losses, got {losses}"
    expected, reference_values = reference_run(gather_batches(recorder), STEPS, input_require_grads, use_reentrant)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=LOSS_TOLERANCE,
                               msg=lambda m: f"Trainer losses {losses} vs reference {expected}: {m}")
    assert_moved_as_reference(trainable_values(model), reference_values, atol=1e-7)


def _trainer_run(use_reentrant: bool, input_require_grads: bool):
    from transformers import Trainer, default_data_collator

    from tests.integration.hf_runs import (RecordingCollator, build_lora_llama, dataset_rows, reset_accelerate,
                                           training_arguments)
    from zero3_recompute.testing.llama_lora import TokenDataset, trainer_class, trainer_zero3_config

    reset_accelerate()
    model = build_lora_llama(use_reentrant=None, input_require_grads=input_require_grads)
    recorder = RecordingCollator(default_data_collator)
    trainer = trainer_class(Trainer)(model=model, args=training_arguments(use_reentrant, trainer_zero3_config()),
                                     train_dataset=TokenDataset(dataset_rows(64)), data_collator=recorder)
    trainer.train()
    return trainer, recorder


# Checkpointing of the bf16 runs: none, non-reentrant (users' default), reentrant (TRL's forced path).
BF16_CHECKPOINTING = {"none": None, "non_reentrant": False, "reentrant": True}
# The bf16 runs against plain torch in bf16 (the same model, fp32 adapters, SGD on the ranks'
# batches put together): bf16 keeps 8 bits of mantissa, so one rounding is 2**-8 relative. The
# ZeRO run's matmuls see 2 rows per rank where the reference sees 4, which a bf16 kernel may
# round otherwise: the losses (fp32, from bf16 logits) within one rounding, the moves (sums of
# gradients through bf16 activations) within four. Seen on 2 CPU ranks: losses 1e-5 apart, and
# bit for bit the same with and without checkpointing.
BF16_LOSS_RTOL = 2.0**-8
BF16_MOVE_RTOL = 4 * 2.0**-8


# fp16 keeps 10 bits of mantissa: one rounding is 2**-11 relative; the same reasoning as bf16's.
FP16_LOSS_RTOL = 2.0**-10
FP16_MOVE_RTOL = 4 * 2.0**-10


class _LossScales:
    """A TrainerCallback (duck-typed) recording deepspeed's loss scale at the start of each step and
    the steps (from 0) its fp16 loss scaler skipped on overflow, as accelerate's optimizer wrapper
    says; None and nothing where nothing is scaled."""

    def __init__(self):
        self.scales = []
        self.skipped = set()

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.scales.append(getattr(getattr(optimizer, "optimizer", None), "loss_scale", None))

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if getattr(optimizer, "step_was_skipped", False):
            self.skipped.add(state.global_step - 1)


def _half_trainer_run(directory: str, use_reentrant, precision: str = "bf16"):
    """HF Trainer as users run it in bf16 or fp16: the saved Llama loaded in that dtype with
    from_pretrained under the Trainer's ZeRO-3 config (HF's template, "auto" values), PEFT LoRA,
    bf16=True or fp16=True; checkpointing off (use_reentrant None) or with that use_reentrant.
    bf16 takes PEFT's defaults (fp32 adapters); fp16 passes autocast_adapter_dtype=False, as TRL
    does under ZeRO-3: with fp32 adapters deepspeed 0.19.2 on takes the first trainable param's
    dtype for its own and scales the loss statically by 1 (docs/known-crashes.md)."""
    import torch
    from transformers import Trainer, default_data_collator

    from tests.integration.hf_runs import (RecordingCollator, ReleasedAfterEveryStep, dataset_rows, hf_zero3_template,
                                           load_peft_defaults, precision_arguments, reset_accelerate,
                                           training_arguments)
    from tests.unit.v1.zero.procedures import fp16_allowed
    from zero3_recompute.testing.llama_lora import TokenDataset, trainer_class

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    reset_accelerate()
    # The arguments first: while their deepspeed config lives, from_pretrained builds under zero.Init.
    args = training_arguments(bool(use_reentrant), hf_zero3_template(), gradient_checkpointing=use_reentrant is not None,
                              **precision_arguments(precision))
    model = load_peft_defaults(directory, dtype, autocast_adapter_dtype=precision == "bf16")
    loaded = ({param.dtype for param in model.parameters() if param.requires_grad},
              {param.dtype for param in model.parameters() if not param.requires_grad})
    expected = ({torch.float32} if precision == "bf16" else {dtype}, {dtype})
    assert loaded == expected, f"loaded (trainable, frozen) dtypes {loaded}, expected {expected}"
    if use_reentrant:
        # Reentrant checkpointing trains nothing whose block input needs no grad (the frozen
        # embedding's output): users enable input grads for it, as TRL does (transformers 5.x's
        # Trainer does it itself).
        model.enable_input_require_grads()
    recorder = RecordingCollator(default_data_collator)
    released, scaled = ReleasedAfterEveryStep(), _LossScales()
    with fp16_allowed(precision == "fp16"):
        trainer = trainer_class(Trainer)(model=model, args=args, train_dataset=TokenDataset(dataset_rows(64)),
                                         data_collator=recorder, callbacks=[released, scaled])
        trainer.train()
    return trainer, recorder, released, scaled


def _check_half(trainer, recorder, released, directory: str, use_reentrant, precision: str = "bf16",
                scaled=None) -> None:
    import torch

    from tests.integration.hf_runs import (STEPS, assert_moved_as_reference, build_outside_zero3, checkpoint_modes,
                                           gather_batches, load_peft_defaults, logged_losses, reference_run,
                                           trainable_masters)
    from tests.unit.zero_state import zero3_params

    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    assert zero3_params(model), "the Trainer did not put the model under ZeRO-3"
    assert released.steps == STEPS, f"the release check ran after {released.steps} of {STEPS} steps"
    if use_reentrant is not None:
        assert checkpoint_modes(model) == {use_reentrant}, \
            f"trained with use_reentrant {checkpoint_modes(model)}, expected {use_reentrant}"
    # PEFT's fp32 adapters stay fp32 from deepspeed 0.19.2 on; earlier releases cast them to bf16.
    trained_as = {param.dtype for param in model.parameters() if param.requires_grad}
    assert len(trained_as) == 1, f"trainable params of dtypes {trained_as}"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    losses = logged_losses(trainer)
    expected, reference_values = reference_run(
        gather_batches(recorder), STEPS, False, False, trainable_dtype=trained_as.pop(),
        loss_scales=scaled.scales if scaled else None, skipped_steps=scaled.skipped if scaled else frozenset(),
        build=lambda **_: build_outside_zero3(load_peft_defaults, directory, dtype,
                                              autocast_adapter_dtype=precision == "bf16"))
    print(f"{precision}, use_reentrant {use_reentrant}: losses {losses}, plain torch {expected}, loss scales "
          f"{scaled.scales if scaled else None}, skipped {scaled.skipped if scaled else None}")
    loss_rtol, move_rtol = (BF16_LOSS_RTOL, BF16_MOVE_RTOL) if precision == "bf16" else (FP16_LOSS_RTOL, FP16_MOVE_RTOL)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=loss_rtol, atol=2e-4,
                               msg=lambda m: f"Trainer losses {losses} vs plain torch in {precision} {expected}: {m}")
    assert_moved_as_reference(trainable_masters(model), reference_values, atol=1e-4, rtol=move_rtol)


def _is_fixed_here() -> bool:
    import zero3_recompute

    return zero3_recompute.status().fixed


@pytest.mark.hf
class TestHFStackRecompute(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.parametrize("input_require_grads", [False, True])
    def test_trainer_peft_lora_non_reentrant(self, input_require_grads):
        """Trainer + PEFT LoRA + ZeRO-3 + use_reentrant=False; with input_require_grads=False the
        frozen embedding feeds the first layer a no-grad input."""
        from tests.integration.hf_runs import require_hf_stack

        require_hf_stack()
        if not _is_fixed_here():
            pytest.xfail("stock deepspeed 0.14.5-0.19.2 raises CheckpointError here (ZERO3_RECOMPUTE_DISABLE set?)")
        trainer, recorder = _trainer_run(use_reentrant=False, input_require_grads=input_require_grads)
        _check(trainer, recorder, input_require_grads, use_reentrant=False)

    def test_trainer_stock_crashes_without_patch(self):
        """The canary: with the patch reverted, the same Trainer run dies in backward."""
        import zero3_recompute
        from torch.utils.checkpoint import CheckpointError

        from tests.integration.hf_runs import require_hf_stack

        require_hf_stack()
        if not stock_crashes():
            pytest.skip(f"{why_stock_trains()}: {zero3_recompute.status()}")
        with patch_reverted(), pytest.raises(CheckpointError):
            _trainer_run(use_reentrant=False, input_require_grads=False)

    @pytest.mark.lane(hf4_only=True)
    @pytest.mark.parametrize("checkpointing", list(BF16_CHECKPOINTING))
    def test_trainer_bf16_peft_defaults(self, checkpointing):
        """bf16 as users run it (the model loaded in bf16, bf16=True, PEFT's fp32 adapters, HF's "auto"
        ZeRO-3 values, deepspeed's prefetch), against plain torch in bf16 within bf16's precision.
        On deepspeed 0.19.2 stock dies at the first step in its list gather of the persistent params
        (bf16 norms and fp32 adapters: deepspeed #8072), whatever the checkpointing."""
        import zero3_recompute

        from tests.integration.hf_runs import (remove_shared, require_hf_stack,
                                               save_base_llama, shared_directory)
        from tests.unit.patch_switch import is_mixed_dtype_gather_crash, mixed_dtype_gather_needed

        require_hf_stack()
        use_reentrant = BF16_CHECKPOINTING[checkpointing]
        if use_reentrant is False and not _is_fixed_here():
            pytest.xfail("stock deepspeed 0.14.5-0.19.2 raises CheckpointError here (ZERO3_RECOMPUTE_DISABLE set?)")
        directory = shared_directory()
        try:
            save_base_llama(directory)
            try:
                trainer, recorder, released, _ = _half_trainer_run(directory, use_reentrant)
            except RuntimeError as error:
                if is_mixed_dtype_gather_crash(error) and mixed_dtype_gather_needed() \
                        and not zero3_recompute.status().active:
                    pytest.xfail(f"stock deepspeed's mixed-dtype list gather (#8072), the package not in charge: {error}")
                raise
            _check_half(trainer, recorder, released, directory, use_reentrant)
        finally:
            remove_shared(directory)

    @pytest.mark.lane(hf4_only=True)
    def test_trainer_fp16_dynamic_loss_scale(self):
        """fp16 with deepspeed's dynamic loss scaling (HF's template: initial scale 2**16), non-reentrant
        checkpointing, the model loaded in fp16: against plain torch in fp16 within fp16's precision,
        each step the scaler skipped on overflow skipped in the reference too."""
        from tests.integration.hf_runs import (remove_shared, require_hf_stack,
                                               save_base_llama, shared_directory)

        require_hf_stack()
        if not _is_fixed_here():
            pytest.xfail("stock deepspeed 0.14.5-0.19.2 raises CheckpointError here (ZERO3_RECOMPUTE_DISABLE set?)")
        directory = shared_directory()
        try:
            save_base_llama(directory)
            trainer, recorder, released, scaled = _half_trainer_run(directory, False, "fp16")
            engine = trainer.model_wrapped
            assert engine.optimizer.dynamic_loss_scale, "deepspeed's loss scaler is static: the premise is lost"
            assert scaled.scales[0] == 2.0**16, f"loss scales {scaled.scales}, expected HF's initial 2**16"
            _check_half(trainer, recorder, released, directory, False, "fp16", scaled)
        finally:
            remove_shared(directory)

    @pytest.mark.lane(hf4_only=True)
    def test_trainer_bf16_stock_crashes_in_gather(self):
        """The canary: where deepspeed's code has #8072 (0.19.2), the bf16 run without checkpointing dies
        on stock in the list gather."""
        from tests.integration.hf_runs import (remove_shared, require_hf_stack,
                                               save_base_llama, shared_directory)
        from tests.unit.patch_switch import is_mixed_dtype_gather_crash, mixed_dtype_gather_needed, patch_reverted

        require_hf_stack()
        if not mixed_dtype_gather_needed():
            pytest.skip("this deepspeed gathers a mixed-dtype list as it should, or casts every param to one dtype")
        directory = shared_directory()
        try:
            save_base_llama(directory)
            with patch_reverted(), pytest.raises(RuntimeError) as raised:
                _half_trainer_run(directory, use_reentrant=None)
        finally:
            remove_shared(directory)
        assert is_mixed_dtype_gather_crash(raised.value), f"stock failed otherwise: {raised.value!r}"

    @pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.lane(hf4_only=True))])
    @pytest.mark.parametrize("restore_non_reentrant", [False, True])
    def test_trl_sft_trainer(self, restore_non_reentrant, precision):
        """TRL's SFTTrainer on the reentrant path and on the non-reentrant one, both training with the
        package. TRL 0.28 and later force use_reentrant=True for PEFT + ZeRO-3 (and enable input
        grads): the run asks for non-reentrant, and the force is undone in the trainer's arguments
        after it is built, taking the path that TRL works around. Earlier TRL (0.24, beside
        transformers 4.57) forces nothing and enables input grads for reentrant checkpointing only:
        the run asks for the path it tests. In fp32, the LoRA Llama against plain torch exactly; in
        bf16 (SFTConfig's default), as users run it: the model loaded in bf16 under HF's "auto"
        ZeRO-3 values, PEFT's defaults, against plain torch in bf16 within bf16's precision."""
        from tests.integration.hf_runs import (RecordingCollator, ReleasedAfterEveryStep, build_lora_llama,
                                               dataset_rows, hf_zero3_template, load_peft_defaults,
                                               precision_arguments, remove_shared, require_hf_stack, reset_accelerate, save_base_llama,
                                               shared_directory,
                                               training_arguments, trl_forces_reentrant, undo_reentrant_force,
                                               word_tokenizer)
        from zero3_recompute.testing.llama_lora import trainer_class, trainer_zero3_config

        require_hf_stack()
        trl = pytest.importorskip("trl", reason="trl is not installed: pip install '.[hf]'")
        if restore_non_reentrant and not _is_fixed_here():
            pytest.xfail("stock deepspeed 0.14.5-0.19.2 raises CheckpointError on the non-reentrant path")
        from datasets import Dataset

        bf16 = precision == "bf16"
        directory = shared_directory() if bf16 else None
        try:
            if bf16:
                save_base_llama(directory)
            forces = trl_forces_reentrant()
            reset_accelerate()
            requested = False if forces else not restore_non_reentrant
            config = training_arguments(requested, hf_zero3_template() if bf16 else trainer_zero3_config(),
                                        cls=trl.SFTConfig, max_length=None, packing=False,
                                        **precision_arguments(precision))
            model = load_peft_defaults(directory) if bf16 else build_lora_llama(use_reentrant=None)
            rows = dataset_rows(64)
            released = ReleasedAfterEveryStep()
            trainer = trainer_class(trl.SFTTrainer)(model=model, args=config, processing_class=word_tokenizer(),
                                                    train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}),
                                                    callbacks=[released])
            assert trainer.args.gradient_checkpointing_kwargs["use_reentrant"] is (forces or requested), \
                f"TRL {trl.__version__} {'no longer forces' if forces else 'now forces'} reentrant checkpointing"
            if restore_non_reentrant and forces:
                undo_reentrant_force(trainer)
            recorder = RecordingCollator(trainer.data_collator)
            trainer.data_collator = recorder
            trainer.train()
            if bf16:
                _check_half(trainer, recorder, released, directory, use_reentrant=not restore_non_reentrant)
            else:
                _check(trainer, recorder, input_require_grads=forces or not restore_non_reentrant,
                       use_reentrant=not restore_non_reentrant)
        finally:
            if directory is not None:
                remove_shared(directory)
