"""TRL's GRPOTrainer under ZeRO-3, 2 ranks: a Llama and a ``peft_config`` (the trainer wraps it in
LoRA), a rule-based reward, a few tokens generated through transformers (no vLLM) with the
policy's ZeRO-3 params gathered for generation, and a KL term (``beta`` > 0) against the
reference, which for a PEFT model is the disabled adapter; the package active as pip install
leaves it.

As TRL ships it (the checkpointing kwargs left unset: reentrant throughout, as GRPO re-enables
checkpointing with TRL's dict around generation, which precedes the first forward;
trl_runs.AS_SHIPPED) and with TRL's force undone, the logged loss per step and every LoRA param at
the end must equal the run of TRL's workaround on stock deepspeed (the patch reverted, reentrant
checkpointing): generation samples from the same seed, so equal weights give equal completions.
Each step's flavour is the one expected, stock as shipped trains or crashes as that flavour says,
and nothing non-persistent is left gathered after any step (trl_runs.py). The canary: with the
patch reverted, the undone run dies with the crash the package fixes.

On the CPU, deepspeed before 0.19.8 can hand generation a param whose all-gather has not landed;
the test ranks wait on each (tests/unit/gloo_gathers.py; NCCL is not affected). TRL before 0.28 is
left out: its GRPO re-enables checkpointing after each generation with transformers' defaults
(reentrant on 4.x), so no run there stays on the path asked for.
Select with ``-m hf``. In CI it runs in the two-version lane (tests/unit/lanes.py).
"""
import re

import pytest

from tests.unit.common import DistributedTest

STEPS = 3
LOSS_TOLERANCE = 1e-8  # GRPO's losses are about 1e-6 here; equal weights, equal completions
PROMPT = 8
_TOKEN = re.compile(r"t(\d+)")


def token_sum_reward(completions, **kwargs):
    """A rule: the completion's token numbers summed, mod 7."""
    return [float(sum(int(number) for number in _TOKEN.findall(text)) % 7) for text in completions]


def _grpo_trainer(use_reentrant: bool, callbacks):
    import trl
    from datasets import Dataset

    from tests.integration.hf_runs import dataset_rows, training_arguments, word_tokenizer
    from zero3_recompute.testing.llama_lora import build_base_llama, lora_config, trainer_class, trainer_zero3_config

    args = training_arguments(use_reentrant, trainer_zero3_config(), cls=trl.GRPOConfig, max_steps=STEPS,
                              learning_rate=0.1, beta=0.04, num_generations=2, max_completion_length=4,
                              temperature=1.0, bf16=False, log_completions=False)
    prompts = [" ".join(f"t{int(index)}" for index in row[:PROMPT]) for row in dataset_rows(32)]
    return trainer_class(trl.GRPOTrainer)(model=build_base_llama(), reward_funcs=token_sum_reward, args=args,
                                          processing_class=word_tokenizer(), peft_config=lora_config(),
                                          train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=callbacks)


FAULT_STEP = 1  # the second step's backward raises; the third generates, then trains


class _InjectedFault(RuntimeError):
    pass


def _faulting_grpo_trainer(skip_backward: bool):
    """_grpo_trainer's trainer, whose step FAULT_STEP loses its backward as an OOM-skip loop loses
    it: the backward raises inside the last layer's recompute, in its MLP, after the attention's
    recompute ran (``skip_backward`` False), or is skipped where it would raise (True: the
    reference). The loop catches the fault, zeroes the gradients and goes on, logging 0 for the
    step; nothing has reached ZeRO-3's reduction by then (the head and the layers above are
    frozen)."""

    def build(use_reentrant, callbacks):
        import torch
        import trl

        base = _grpo_trainer(use_reentrant, list(callbacks) + ([] if skip_backward else [_BooksClosed()]))

        class FaultOnce(type(base)):
            def training_step(self, model, inputs, *args, **kwargs):
                if self.state.global_step != FAULT_STEP:
                    return super().training_step(model, inputs, *args, **kwargs)
                return self._step_without_backward(model, inputs, *args, **kwargs)

            def _step_without_backward(self, model, inputs, *args, **kwargs):
                layer = _decoder_layers(model)[-1]
                if skip_backward:
                    backward, self.accelerator.backward = self.accelerator.backward, lambda *a, **k: None
                    try:
                        super().training_step(model, inputs, *args, **kwargs)
                    finally:
                        self.accelerator.backward = backward
                else:
                    handle = layer.mlp.register_forward_pre_hook(_raise_in_backward)
                    try:
                        super().training_step(model, inputs, *args, **kwargs)
                        raise AssertionError("the armed backward did not raise")
                    except _InjectedFault:
                        pass
                    finally:
                        handle.remove()
                model.zero_grad()
                return torch.tensor(0.0, device=self.args.device)

        base.__class__ = FaultOnce
        assert isinstance(base, trl.GRPOTrainer)
        return base

    return build


class _BooksClosed:
    """A TrainerCallback (duck-typed): after each step from the one after the fault on, the package
    keeps no books of any graph task and holds nothing, though TRL's generation cleared every
    param's ds_active_sub_modules (the tokens of the raised backward's holds) in between."""

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, **kwargs):
        from zero3_recompute.patch import graph_tasks_on_the_books, held_params

        if state.global_step > FAULT_STEP + 1:
            books, held = graph_tasks_on_the_books(), len(held_params())
            assert (books, held) == (0, 0), \
                f"after step {state.global_step}: {books} graph tasks on the books, {held} params held"


def _raise_in_backward(module, args):
    import torch

    if torch._C._current_graph_task_id() != -1:
        raise _InjectedFault("injected fault in a checkpoint recompute")


def _decoder_layers(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def _require_trl_that_forces():
    import trl
    from packaging.version import Version

    if Version(trl.__version__) < Version("0.28"):
        pytest.skip(f"TRL {trl.__version__}'s GRPO re-enables checkpointing with transformers' defaults after "
                    "each generation")


def _require_trl_hooks():
    """TRL re-registers ZeRO-3's module hooks after generation with
    DeepSpeedZeRoOffload._register_deepspeed_module, which deepspeed before 0.15 lacks."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    if not hasattr(DeepSpeedZeRoOffload, "_register_deepspeed_module"):
        pytest.skip("TRL's GRPO needs DeepSpeedZeRoOffload._register_deepspeed_module, which this deepspeed lacks")


@pytest.mark.hf
class TestGRPO(DistributedTest):
    world_size = 2
    timeout = 400

    @pytest.mark.lane
    def test_grpo_trains_as_stock_reentrant(self):
        from tests.integration.trl_runs import assert_trains_as_stock, compared_modes, require_trl, runs_as_shipped

        require_trl()
        _require_trl_that_forces()
        _require_trl_hooks()
        runs = runs_as_shipped("grpo", _grpo_trainer, compared_modes() + ("shipped_on_stock",), STEPS)
        history = runs["stock"]["history"]
        spread = [entry["reward_std"] for entry in history if "reward_std" in entry]
        kl = [entry["kl"] for entry in history if "kl" in entry]
        assert any(value > 0 for value in spread), f"no reward spread within a group: nothing to learn ({spread})"
        assert any(value > 0 for value in kl), f"the KL term against the reference stayed 0: {kl}"
        assert_trains_as_stock(runs, STEPS, LOSS_TOLERANCE, value_tolerance=1e-6)

    @pytest.mark.lane
    def test_stock_crashes_undone(self):
        """The canary: the force undone and the patch reverted, GRPO dies in its first backward."""
        from tests.integration.trl_runs import require_trl, trl_run
        from tests.unit.patch_switch import assert_stock_crashes

        require_trl()
        _require_trl_that_forces()
        _require_trl_hooks()
        assert_stock_crashes(lambda: trl_run(_grpo_trainer, "undone", on_stock=True))

    @pytest.mark.lane
    def test_fault_then_generation_then_next_step(self):
        """Step 2's backward raises inside a recompute and the loop goes on; step 3 generates (TRL
        gathers the model and takes deepspeed's hooks off and back on, clearing every param's
        ds_active_sub_modules, where the package's holds live), then trains. As shipped and
        undone: nothing asserts, nothing is left gathered after any step (the faulted one's
        leftovers go before the next forward), the package keeps no books and holds nothing from
        then on, and the losses and LoRA params equal the reference's (TRL's workaround on stock,
        the same backward skipped). Mutation: HoldLedger.close_ended doing nothing fails it.
        deepspeed's count of gathered numel is not checked: TRL's generation leaves it at -2048
        after a normal step, on stock too."""
        from tests.integration.trl_runs import (assert_trains_as_stock, compared_modes, reference_run, require_trl,
                                                trl_run)

        require_trl()
        _require_trl_that_forces()
        _require_trl_hooks()
        runs = {"stock": reference_run(_faulting_grpo_trainer(skip_backward=True))}
        runs.update((mode, trl_run(_faulting_grpo_trainer(skip_backward=False), mode, faulted_step=FAULT_STEP + 1))
                    for mode in compared_modes())
        print("\n".join(f"{mode}: losses {run['losses']}, use_reentrant per step {run['flavours']}"
                        for mode, run in runs.items()))
        assert all(run["losses"][FAULT_STEP] == 0.0 for run in runs.values()), "the faulted step logged a loss"
        assert_trains_as_stock(runs, STEPS, LOSS_TOLERANCE, value_tolerance=1e-6)

