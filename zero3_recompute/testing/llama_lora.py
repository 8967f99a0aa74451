"""The small LoRA Llama, its data and ZeRO-3 config, shared by the examples and the HF tests."""
from typing import Optional

import torch

VOCAB = 128
SEQ = 32
HIDDEN = 64
LAYERS = 2


def build_lora_llama(use_reentrant: Optional[bool] = False, seed: int = 0, input_require_grads: bool = False,
                     layers: int = LAYERS):
    """LlamaForCausalLM from a LlamaConfig (random init, no download), ``layers`` decoder layers,
    LoRA on q_proj/v_proj, activation checkpointing (none where use_reentrant is None: the
    Trainer's arguments turn it on). Every base weight is frozen, the embedding included."""
    from peft import get_peft_model

    model = build_base_llama(seed, layers)
    if use_reentrant is not None:
        enable_checkpointing(model, use_reentrant)
    if input_require_grads:
        model.enable_input_require_grads()
    return get_peft_model(model, lora_config())


def build_base_llama(seed: int = 0, layers: int = LAYERS):
    """The base LlamaForCausalLM of build_lora_llama, without LoRA or checkpointing: what a
    trainer given a ``peft_config`` (lora_config()) wraps itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2 * SEQ, use_cache=False)
    return LlamaForCausalLM(config)


def lora_config():
    """LoRA on q_proj/v_proj, rank 8."""
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def enable_checkpointing(model, use_reentrant: bool) -> None:
    """transformers 5 calls it activation checkpointing; 4.x only has the gradient_* name."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def trainer_class(base):
    """``base`` (transformers' Trainer, or a subclass such as TRL's SFTTrainer), or, on transformers
    before 5.1, a subclass of it whose optimizer has no empty param group.

    deepspeed.initialize drops the client optimizer's empty param groups in place
    (DeepSpeedEngine._configure_optimizer, on every deepspeed of the matrix). A LoRA model leaves
    the Trainer's no-weight-decay group empty: its only trainable params are the lora_A/lora_B
    weights. transformers before 5.1 builds its LR scheduler on the optimizer before deepspeed's
    set-up, one learning rate per group, and torch >= 2.10 zips the two strictly
    (LRScheduler._update_lr), so the first lr_scheduler.step() raises "zip() argument 2 is longer
    than argument 1". transformers 5.1 builds the scheduler after deepspeed's set-up
    (transformers #43711). A full fine-tune has no empty group and trains; none of it concerns
    zero3-recompute. Dropping the empty groups when the optimizer is created, as deepspeed would,
    keeps the scheduler in step with it.
    """
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.1"):
        return base

    class WithoutEmptyParamGroups(base):
        def create_optimizer(self, *args, **kwargs):
            optimizer = super().create_optimizer(*args, **kwargs)
            optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
            return optimizer

    return WithoutEmptyParamGroups


def token_batch(step: int, rank: int, micro_batch: int) -> torch.Tensor:
    """Counting sequences mod VOCAB from random starts: learnable, and different per rank and step."""
    generator = torch.Generator().manual_seed(10_000 * rank + step)
    starts = torch.randint(0, VOCAB, (micro_batch, 1), generator=generator)
    strides = torch.randint(1, 4, (micro_batch, 1), generator=generator)
    return (starts + strides * torch.arange(SEQ)) % VOCAB


class TokenDataset(torch.utils.data.Dataset):
    """Rows of token ids as causal-LM examples, for the HF Trainer."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index].clone()}


def trainer_zero3_config() -> dict:
    """ZeRO-3 for the HF Trainer: batch size, accumulation and clipping come from its arguments."""
    return dict(zero3_config("auto", "auto"), gradient_clipping="auto")


def zero3_config(micro_batch, gradient_accumulation=1) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gradient_accumulation,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
