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
        from tests.integration.trl_runs import (as_shipped_row, assert_as_shipped, assert_trains_as_stock,
                                                compared_modes, reference_run, require_trl, trl_run)

        require_trl()
        _require_trl_that_forces()
        _require_trl_hooks()
        runs = {"stock": reference_run(_grpo_trainer)}
        runs.update((mode, trl_run(_grpo_trainer, mode)) for mode in compared_modes() + ("shipped_on_stock",))
        print("\n".join(f"{mode}: losses {run['losses']}, use_reentrant per step {run['flavours']}, {run['outcome']}"
                        for mode, run in runs.items()))
        print(as_shipped_row("grpo", runs))
        assert_as_shipped("grpo", runs, STEPS)
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
