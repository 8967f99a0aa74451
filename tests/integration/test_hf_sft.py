"""TRL's SFTTrainer under ZeRO-3 as users write it, 2 ranks: ``SFTConfig(gradient_checkpointing=True)``
with the checkpointing kwargs left unset, bf16 under HF's "auto" ZeRO-3 values, the model given by
its path (TRL loads it, under zero.Init) and a ``peft_config`` of PEFT's defaults (TRL wraps it in
LoRA), with the package active as pip install leaves it.

On transformers 5.x TRL's forced ``use_reentrant=True`` never reaches train(), which reads only
``activation_checkpointing_kwargs``: every step trains non-reentrant (trl_runs.AS_SHIPPED), the
path the package fixes; on 4.57 every step is reentrant. Either way the logged loss per step and
every LoRA param at the end must equal the run of TRL's workaround on stock deepspeed (the patch
reverted, ``use_reentrant=True`` passed; where stock dies of deepspeed #8072's mixed-dtype gather
in any flavour, as 0.19.2 does under TRL 0.24's fp32 adapters, the same with the package), each
step's flavour is the one expected, and nothing non-persistent is left gathered after any step.
Stock as shipped crashes where a step ran non-reentrant (or in #8072's gather), or trains as the
reference.

Select with ``-m hf``. In CI it runs in the two-version lane (tests/unit/lanes.py).
"""
import pytest

from tests.unit.common import DistributedTest

STEPS = 3
# bf16 activations, fp32 adapters (PEFT's default): a reentrant and a non-reentrant recompute of the
# same bf16 forward, and deepspeed's own handling, give the same numbers from the same seed (seen:
# bit for bit on 2 CPU ranks, transformers 5.24 and 4.57, deepspeed 0.19.2 and 0.19.8).
LOSS_TOLERANCE = 1e-5
VALUE_TOLERANCE = 1e-6


def _sft_builder(directory: str):
    def build(use_reentrant, callbacks):
        import trl
        from datasets import Dataset
        from peft import LoraConfig

        from tests.integration.hf_runs import (dataset_rows, hf_zero3_template, precision_arguments,
                                               training_arguments, word_tokenizer)
        from zero3_recompute.testing.llama_lora import trainer_class

        # The arguments first: while their deepspeed config lives, TRL's from_pretrained builds under zero.Init.
        args = training_arguments(use_reentrant, hf_zero3_template(), cls=trl.SFTConfig, max_steps=STEPS,
                                  learning_rate=0.5, max_length=None, packing=False, **precision_arguments("bf16"))
        return trainer_class(trl.SFTTrainer)(model=directory, args=args, processing_class=word_tokenizer(),
                                             peft_config=LoraConfig(task_type="CAUSAL_LM"),
                                             train_dataset=Dataset.from_dict({"input_ids": dataset_rows(32).tolist()}),
                                             callbacks=callbacks)

    return build


@pytest.mark.hf
class TestSFTAsShipped(DistributedTest):
    world_size = 2
    timeout = 400

    @pytest.mark.lane
    def test_sft_as_shipped_trains_as_stock_reentrant(self):
        from tests.integration.hf_runs import remove_shared, save_base_llama, shared_directory
        from tests.integration.trl_runs import assert_trains_as_stock, require_trl, runs_as_shipped

        require_trl()
        directory = shared_directory()
        try:
            save_base_llama(directory)
            runs = runs_as_shipped("sft", _sft_builder(directory), ("shipped", "shipped_on_stock"), STEPS)
        finally:
            remove_shared(directory)
        assert_trains_as_stock(runs, STEPS, LOSS_TOLERANCE, VALUE_TOLERANCE)
