"""The model families users fine-tune, built tiny from their configs (random init, no download),
saved, and loaded back with from_pretrained under ZeRO-3 as a user's script loads them; then PEFT
LoRA with PEFT's default target modules for the family, and an engine run.

Each family stands for a shape the Llama of the other tests lacks (``FAMILIES[...].shape``).
"""
from dataclasses import dataclass, field
from typing import Dict, List

import torch

from zero3_recompute.testing.llama_lora import SEQ, VOCAB, enable_checkpointing, token_batch

HIDDEN = 64
MICRO_BATCH = 2
STEPS = 3
# Plain SGD: a param's move is its summed gradients times this.
LR = 0.5


@dataclass(frozen=True)
class Family:
    model_type: str
    shape: str
    config: Dict = field(default_factory=dict)
    seq2seq: bool = False


_DECODER = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=2 * SEQ)

FAMILIES = {
    "qwen2": Family("qwen2", "grouped-query attention, q/k/v biases", dict(_DECODER, num_key_value_heads=2)),
    "qwen3": Family("qwen3", "a norm on q and k per head", dict(_DECODER, num_key_value_heads=2, head_dim=16)),
    "mistral": Family("mistral", "grouped-query attention", dict(_DECODER, num_key_value_heads=2, sliding_window=None)),
    "gemma": Family("gemma", "tied embeddings, embeddings scaled by sqrt(hidden), one kv head",
                    dict(_DECODER, num_key_value_heads=1, head_dim=16)),
    "phi": Family("phi", "partial rotary, parallel attention and MLP, LoRA on the MLP too (fc1, fc2)",
                  dict(_DECODER, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "gpt2": Family("gpt2", "Conv1D projections (fused c_attn), tied embeddings, learned positions",
                   dict(n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=2 * SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)),
    "t5": Family("t5", "encoder-decoder: cross-attention over the frozen encoder's output, tied embeddings",
                 dict(d_model=HIDDEN, d_ff=2 * HIDDEN, d_kv=16, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1), seq2seq=True),
}


def _auto_class(family: Family):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if family.seq2seq else AutoModelForCausalLM


def save_tiny(name: str, directory: str) -> None:
    """Rank 0 builds the family's tiny model from its config (seeded) and saves it; every rank waits."""
    from transformers import AutoConfig

    from tests.integration.hf_runs import build_outside_zero3

    family = FAMILIES[name]
    if torch.distributed.get_rank() == 0:
        config = AutoConfig.for_model(family.model_type, vocab_size=VOCAB, use_cache=False, **family.config)
        torch.manual_seed(0)
        # Outside any ZeRO-3 config an earlier Trainer left alive: zero.Init's broadcasts on rank 0
        # alone would wait for the other ranks forever.
        build_outside_zero3(_auto_class(family).from_config, config).save_pretrained(directory)
    torch.distributed.barrier()


def zero3_config() -> dict:
    """HF's ZeRO-3 template with its "auto" values as the Trainer fills them for this hidden size
    (persistence 10 h, prefetch 0.9 h², reduce bucket h²), deepspeed's other defaults."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": HIDDEN * HIDDEN, "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
            "stage3_param_persistence_threshold": 10 * HIDDEN, "stage3_max_live_parameters": 10**9,
            "stage3_max_reuse_distance": 10**9, "stage3_gather_16bit_weights_on_model_save": True,
        },
    }


def load_lora(name: str, directory: str, config: dict, checkpointing: bool):
    """from_pretrained under ZeRO-3 (zero.Init, through transformers' HfDeepSpeedConfig), then
    PEFT LoRA with its defaults for the family (seeded), checkpointing non-reentrant or off."""
    from peft import LoraConfig, get_peft_model
    from transformers.integrations import HfDeepSpeedConfig

    family = FAMILIES[name]
    keep_alive = HfDeepSpeedConfig(config)  # while it lives, from_pretrained builds under zero.Init
    model = _auto_class(family).from_pretrained(directory, dtype=torch.float32)
    del keep_alive
    if checkpointing:
        enable_checkpointing(model, use_reentrant=False)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=8, task_type="SEQ_2_SEQ_LM" if family.seq2seq else "CAUSAL_LM"))


def run(name: str, directory: str, checkpointing: bool, steps: int = STEPS):
    """The family's LoRA model through a ZeRO-3 engine: (the mean loss per step, how far each
    trainable param moved); every non-persistent param released after every step."""
    import deepspeed

    from tests.integration.hf_runs import checkpoint_modes
    from tests.unit.v1.zero.scenario_runner import gathered_trainable
    from tests.unit.zero_state import assert_all_released, zero3_params

    config = zero3_config()
    model = load_lora(name, directory, config, checkpointing)
    trainable = [param for param in model.parameters() if param.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=LR), config=config)
    assert zero3_params(engine.module), f"{name}: the model is not under ZeRO-3"
    engine.train()  # from_pretrained leaves eval mode, in which transformers' layers do not checkpoint
    if checkpointing:
        assert checkpoint_modes(engine.module) == {False}, f"{name}: checkpointing {checkpoint_modes(engine.module)}"
    initial = gathered_trainable(engine.module)
    rank, losses = torch.distributed.get_rank(), []
    for step in range(steps):
        input_ids = token_batch(step, rank, MICRO_BATCH).to(engine.device)
        loss = engine(input_ids=input_ids, labels=input_ids).loss
        engine.backward(loss)
        engine.step()
        assert_all_released(engine.module, f"{name}, after step {step}")
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
    final = gathered_trainable(engine.module)
    return losses, {param_name: final[param_name] - value for param_name, value in initial.items()}


def assert_as_without(label: str, losses, moves, expected_losses, expected_moves, loss_rtol: float,
                      move_rtol: float, move_atol: float) -> None:
    """A checkpointed run against the same run without checkpointing: the same loss per step, and
    each trainable param moved as far; every param moved without checkpointing, or the comparison
    would be empty."""
    print(f"{label}: losses {losses}, without checkpointing {expected_losses}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=loss_rtol, atol=0,
                               msg=lambda m: f"{label}: losses {losses} vs no checkpointing {expected_losses}: {m}")
    assert moves.keys() == expected_moves.keys(), f"{label}: {sorted(moves)} vs {sorted(expected_moves)}"
    assert all(move.abs().max() > 0 for move in expected_moves.values()), \
        f"{label}: a trainable param did not move without checkpointing: the comparison would be empty"
    for name, expected in expected_moves.items():
        torch.testing.assert_close(moves[name], expected, rtol=move_rtol, atol=move_atol,
                                   msg=lambda m: f"{label}: how far {name} moved vs no checkpointing: {m}")


def family_names() -> List[str]:
    return list(FAMILIES)


