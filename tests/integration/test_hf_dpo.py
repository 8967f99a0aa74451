"""TRL's DPOTrainer under ZeRO-3, 2 ranks: a Llama and a ``peft_config``, so that the trainer wraps
it in LoRA itself and computes the reference log-probs through the disabled adapter (no reference
model), with the package active as pip install leaves it.

As TRL ships it (the checkpointing kwargs left unset: on transformers 5.x non-reentrant in step 1,
then reentrant once DPO re-enables checkpointing with TRL's dict around its reference pass;
trl_runs.AS_SHIPPED) and with TRL's force undone, the logged loss per step and every LoRA param at
the end must equal the run of TRL's workaround on stock deepspeed (the patch reverted, reentrant
checkpointing), each step's flavour is the one expected, and nothing non-persistent is left
gathered after any step (trl_runs.py). Stock as shipped crashes where a step ran non-reentrant, or
trains as the reference. The canary: with the patch reverted, the undone run dies with the crash
the package fixes.

Select with ``-m hf``. In CI it runs in the two-version lane (tests/unit/lanes.py).
"""
import pytest

from tests.unit.common import DistributedTest

STEPS = 3
LOSS_TOLERANCE = 1e-5  # the loss moves by about 3e-4 a step here
PROMPT, COMPLETION = 12, 8


def _preference_rows(count: int) -> dict:
    """A counting prompt, its continuation as the chosen completion, and the same tokens reversed
    as the rejected one, as words of hf_runs.word_tokenizer's vocabulary."""
    from tests.integration.hf_runs import dataset_rows

    def words(ids):
        return " ".join(f"t{int(index)}" for index in ids)

    rows = dataset_rows(count)
    return {"prompt": [words(row[:PROMPT]) for row in rows],
            "chosen": [" " + words(row[PROMPT:PROMPT + COMPLETION]) for row in rows],
            "rejected": [" " + words(row[PROMPT:PROMPT + COMPLETION].flip(0)) for row in rows]}


def _dpo_trainer(use_reentrant: bool, callbacks):
    import trl
    from datasets import Dataset

    from tests.integration.hf_runs import training_arguments, word_tokenizer
    from zero3_recompute.testing.llama_lora import build_base_llama, lora_config, trainer_class, trainer_zero3_config

    args = training_arguments(use_reentrant, trainer_zero3_config(), cls=trl.DPOConfig, max_steps=STEPS,
                              beta=0.1, max_length=None, bf16=False)
    return trainer_class(trl.DPOTrainer)(model=build_base_llama(), ref_model=None, args=args,
                                         processing_class=word_tokenizer(), peft_config=lora_config(),
                                         train_dataset=Dataset.from_dict(_preference_rows(32)), callbacks=callbacks)


@pytest.mark.hf
class TestDPO(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.lane
    def test_dpo_trains_as_stock_reentrant(self):
        from tests.integration.trl_runs import assert_trains_as_stock, compared_modes, require_trl, runs_as_shipped

        require_trl()
        runs = runs_as_shipped("dpo", _dpo_trainer, compared_modes() + ("shipped_on_stock",), STEPS)
        margins = [entry["rewards/margins"] for entry in runs["stock"]["history"] if "rewards/margins" in entry]
        assert any(margin != 0 for margin in margins), f"DPO learned nothing in the reference: margins {margins}"
        assert_trains_as_stock(runs, STEPS, LOSS_TOLERANCE, value_tolerance=1e-6)

    @pytest.mark.lane
    def test_stock_crashes_undone(self):
        """The canary: the force undone and the patch reverted, DPO dies in its first backward."""
        from tests.integration.trl_runs import require_trl, trl_run
        from tests.unit.patch_switch import assert_stock_crashes

        require_trl()
        assert_stock_crashes(lambda: trl_run(_dpo_trainer, "undone", on_stock=True))
