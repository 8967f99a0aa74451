"""The 4-bit QLoRA Llama of the QLoRA tests: the HF tests' tiny Llama saved with save_pretrained
and loaded back with from_pretrained under bitsandbytes' 4-bit NF4 quantization, its packed
weights stored in the model's dtype (bnb_4bit_quant_storage), which is what lets ZeRO-3
partition them; PEFT LoRA on q_proj/v_proj. No hub: the checkpoint is a local folder.
"""
import tempfile
from typing import Optional

import torch

from zero3_recompute.testing.llama_lora import HIDDEN, SEQ, VOCAB, enable_checkpointing

DTYPE = torch.float32


def require_bitsandbytes() -> None:
    import pytest

    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install '.[hf]' "
                        "(requirements/hf.txt)")


def save_tiny_llama(layers: int, seed: int = 0) -> str:
    """A random LlamaForCausalLM of ``layers`` decoder layers, built with no ZeRO-3 config in force
    (transformers would build it partitioned) and saved by rank 0 (transformers writes on rank 0
    alone) to a fresh folder every rank loads from."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    folder = [None]
    if torch.distributed.get_rank() == 0:
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=2 * SEQ, use_cache=False)
        folder[0] = tempfile.mkdtemp(prefix="zero3_recompute_tiny_llama_")
        LlamaForCausalLM(config).save_pretrained(folder[0])
    torch.distributed.broadcast_object_list(folder, src=0)
    return folder[0]


def load_qlora(folder: str, use_reentrant: Optional[bool], input_require_grads: bool = False, seed: int = 1):
    """The 4-bit model from ``folder`` with LoRA, checkpointing (none where use_reentrant is None).
    Under a ZeRO-3 config in force (TrainingArguments(deepspeed=...), HfDeepSpeedConfig),
    transformers loads it partitioned."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=DTYPE,
                                      bnb_4bit_quant_storage=DTYPE)
    model = LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=DTYPE)
    if use_reentrant is not None:
        enable_checkpointing(model, use_reentrant)
    if input_require_grads:
        model.enable_input_require_grads()
    torch.manual_seed(seed)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def quantized_frozen_params(model) -> list:
    """The packed 4-bit weights (bitsandbytes' Params4bit), as ZeRO-3 partitions them."""
    return [param for param in model.parameters() if type(param).__name__ == "Params4bit"]
