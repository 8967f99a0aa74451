"""HF Trainer / TRL SFTTrainer runs of the LoRA Llama under ZeRO-3, and their plain-torch reference.

Each run records the batches its data collator hands to the model, on every rank. The reference
is the same model, seed and optimizer without ZeRO or any distribution, stepped on the ranks'
batches put together: its loss per step must equal the Trainer's logged loss (the mean of the
ranks' losses, which is the loss over all their rows, as every row has the same token count),
and its trainable params must have moved as the Trainer's did. The optimizer is plain SGD, so
that a param's move is its gradient times the learning rate: Adam would normalise a
mis-scaled gradient away.
"""
import os
import tempfile
from typing import Dict, List, Optional

import torch

from tests.unit.v1.zero.plain_torch import FP32MasterSGD
from zero3_recompute.testing.cpu_ranks import make_accelerate_see_ranks
from zero3_recompute.testing.llama_lora import VOCAB, build_lora_llama, token_batch, zero3_config

MICRO_BATCH = 2
STEPS = 4
# Plain SGD: large enough that LoRA A, which starts with no gradient (PEFT zeroes B), moves in 4 steps.
LR = 1.0


def require_hf_stack() -> None:
    import pytest

    for name in ("transformers", "peft", "accelerate"):
        pytest.importorskip(name, reason=f"{name} is not installed: pip install '.[hf]' (requirements/hf.txt)")


def hf_zero3_template(bf16: bool = True) -> dict:
    """The ZeRO-3 config of HF's DeepSpeed guide, "auto" where it says so: the Trainer fills the
    batch sizes, clipping, bf16, fp16 and the buckets from its arguments and the model
    (persistence 10 h, prefetch 0.9 h², reduce bucket h²); deepspeed's defaults elsewhere."""
    return {
        "bf16": {"enabled": "auto" if bf16 else False},
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    }


def precision_arguments(precision: str) -> dict:
    """TrainingArguments for "bf16" or "fp16" as users pass it (bf16=True, fp16=True), or "fp32"; on a
    machine without CUDA also use_cpu=True, without which transformers refuses bf16 ("Your setup
    doesn't support bf16/gpu")."""
    if precision == "fp32":
        return {"bf16": False}
    return {precision: True, **({} if torch.cuda.is_available() else {"use_cpu": True})}


def shared_directory() -> str:
    """A fresh folder, the same on every rank (rank 0 makes it)."""
    made = [tempfile.mkdtemp(prefix="zero3_recompute_hf_model_") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(made, src=0)
    return made[0]


def save_base_llama(directory: str) -> None:
    """Rank 0 saves build_base_llama() (fp32, seeded) where from_pretrained can load it; every rank waits."""
    from zero3_recompute.testing.llama_lora import build_base_llama

    if torch.distributed.get_rank() == 0:
        # Outside any ZeRO-3 config an earlier Trainer left alive (build_outside_zero3): zero.Init's
        # broadcasts on rank 0 alone would wait for the other ranks forever.
        build_outside_zero3(build_base_llama).save_pretrained(directory)
    torch.distributed.barrier()


def load_peft_defaults(directory: str, dtype: torch.dtype = torch.bfloat16, autocast_adapter_dtype: bool = True):
    """The saved Llama loaded in ``dtype`` with from_pretrained (under ZeRO-3 where a Trainer's
    deepspeed config is alive), wrapped in PEFT LoRA with PEFT's defaults (r 8, q_proj and v_proj,
    fp32 adapters: autocast_adapter_dtype=True), seeded."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=dtype)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"), autocast_adapter_dtype=autocast_adapter_dtype)


def remove_shared(directory: str) -> None:
    import shutil

    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


def dataset_rows(count: int) -> torch.Tensor:
    return torch.cat([token_batch(1000 + index, 0, 1) for index in range(count)])


class RecordingCollator:
    """Wraps a data collator and keeps what it returns, in order.

    It masks each row's first label (-100). A causal LM never predicts that token (its loss
    shifts the labels by one), but the Trainer of transformers 4.57 counts the tokens it divides
    the loss by over the unshifted labels, scaling the loss and every gradient by 31/32 here
    (5.24 counts labels[..., 1:]). With the first label masked, every version divides by the
    tokens the loss uses, as the reference does.
    """

    def __init__(self, collate):
        self.collate = collate
        self.batches: List[Dict[str, torch.Tensor]] = []

    def __call__(self, features):
        batch = self.collate(features)
        batch["labels"][:, 0] = -100
        self.batches.append({key: value.clone() for key, value in batch.items() if torch.is_tensor(value)})
        return batch


def reset_accelerate() -> None:
    """A fresh accelerate state for each run in a long-lived rank, seeing the real ranks. Also
    what an earlier run's TrainingArguments left in the environment: transformers 4.x exports
    ACCELERATE_MIXED_PRECISION for a bf16 or fp16 run and never takes it back, so a later fp32 run
    in the same rank would train under bf16 autocast."""
    from accelerate.state import AcceleratorState

    os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
    AcceleratorState._reset_state(reset_partial_state=True)
    make_accelerate_see_ranks()


def training_arguments(use_reentrant: Optional[bool], deepspeed_config, cls=None, **extra):
    """TrainingArguments (or ``cls``, e.g. TRL's SFTConfig) for a short, deterministic run;
    ``extra`` adds arguments or replaces these. ``use_reentrant`` None leaves the checkpointing
    kwargs unset, as users' scripts do."""
    from transformers import TrainingArguments

    arguments = dict(
        output_dir=tempfile.mkdtemp(prefix="zero3_recompute_hf_"), per_device_train_batch_size=MICRO_BATCH,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True, optim="sgd",
        dataloader_num_workers=0, deepspeed=deepspeed_config, gradient_checkpointing=True,
        # Keep the process state reset_accelerate() configured (TrainingArguments resets it otherwise).
        accelerator_config={"use_configured_state": True})
    if use_reentrant is not None:
        arguments["gradient_checkpointing_kwargs"] = {"use_reentrant": use_reentrant}
    arguments.update(extra)
    return (cls or TrainingArguments)(**arguments)


def checkpoint_modes(model) -> set:
    """The use_reentrant of every checkpointed module's checkpoint function, as training left it."""
    return {module._gradient_checkpointing_func.keywords.get("use_reentrant") for module in model.modules()
            if getattr(module, "gradient_checkpointing", False)}


def trl_forces_reentrant() -> bool:
    """TRL 0.28 and later force use_reentrant=True into the arguments for PEFT + ZeRO-3 + checkpointing."""
    import trl
    from packaging.version import Version

    return Version(trl.__version__) >= Version("0.28")


def undo_reentrant_force(trainer) -> None:
    """Takes TRL's forced reentrant path back to non-reentrant. Trainer.train() enables
    checkpointing from the arguments, so the change goes there: re-enabling it on the model alone
    is overridden when training starts. transformers 5 names them activation_checkpointing_kwargs
    and keeps gradient_checkpointing_kwargs as an alias."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        kwargs = getattr(trainer.args, name, None)
        if kwargs is not None:
            kwargs["use_reentrant"] = False


def logged_losses(trainer) -> List[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def trainable_masters(model) -> Dict[str, torch.Tensor]:
    """Every trainable param's full fp32 master, as deepspeed's ZeRO optimizer steps it (what it
    holds of a bf16 param is that, rounded)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {name: safe_get_full_fp32_param(param).detach().cpu().clone() for name, param in model.named_parameters()
            if param.requires_grad}


def trainable_values(model) -> Dict[str, torch.Tensor]:
    """Every trainable param's full value, gathered where ZeRO-3 partitions it."""
    import deepspeed

    values = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                values[name] = param.detach().clone()
    return values


def reference_run(batches_per_rank: List[List[Dict[str, torch.Tensor]]], steps: int, input_require_grads: bool,
                  use_reentrant: bool, build=None, trainable_dtype: Optional[torch.dtype] = None,
                  loss_scales: Optional[List[float]] = None, skipped_steps=frozenset()):
    """Plain torch: the same LoRA Llama (or ``build(use_reentrant, input_require_grads)``'s model)
    and SGD, one step per list of the ranks' batches. Returns the loss per step and each trainable
    param's (initial, final) value, of its fp32 master.

    SGD steps fp32 masters of the trainable params, as deepspeed's ZeRO optimizer does, and copies
    them back; ``trainable_dtype`` casts the trainable params first, as deepspeed before 0.19.2
    casts PEFT's fp32 adapters into a bf16 engine (in fp32 throughout, the same as plain SGD). In
    fp16, each step's loss is scaled by ``loss_scales[step]`` before backward and its gradients
    unscaled after, as deepspeed's loss scaler does, and the steps in ``skipped_steps`` (those it
    skipped on overflow) update nothing."""
    model = (build or _default_build)(use_reentrant=use_reentrant, input_require_grads=input_require_grads)
    model.train()
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if trainable_dtype is not None:
        for _, param in trainable:
            param.data = param.data.to(trainable_dtype)
    optimizer = FP32MasterSGD([param for _, param in trainable], LR)
    initial = {name: master.detach().clone() for (name, _), master in zip(trainable, optimizer.masters)}
    losses = []
    for step in range(steps):
        batch = {key: torch.cat([rank_batches[step][key] for rank_batches in batches_per_rank])
                 for key in batches_per_rank[0][step]}
        loss = model(**batch).loss
        scale = loss_scales[step] if loss_scales and loss_scales[step] else 1.0
        (loss * scale).backward()
        optimizer.step(grad_scale=scale, skip=step in skipped_steps)
        losses.append(loss.item())
    return losses, {name: (initial[name], master.detach().clone())
                    for (name, _), master in zip(trainable, optimizer.masters)}


def exact_bytes_config(micro_batch: int, gradient_accumulation: int = 1) -> dict:
    """The ZeRO-3 config of the measured runs: prefetch, reuse distance and persistence threshold
    0, so that the bytes gathered are exact."""
    config = zero3_config(micro_batch, gradient_accumulation)
    config["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    return config


def token_inputs(micro: int, rank: int, micro_batch: int) -> Dict[str, torch.Tensor]:
    """A causal LM's inputs for one micro-batch: token_batch's rows, as input ids and labels."""
    input_ids = token_batch(micro, rank, micro_batch)
    return {"input_ids": input_ids, "labels": input_ids}


def build_outside_zero3(build, *args, **kwargs):
    """``build(*args, **kwargs)`` with no ZeRO-3 config of transformers in force: an earlier
    test's Trainer leaves its HfDeepSpeedConfig alive until gc, and while it lives sub-models
    built from their config (LLaVA's) are built under zero.Init, with another random init."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return build(*args, **kwargs)


def train_measured(engine, micro_steps: int, micro_batch: int, make_inputs=token_inputs):
    """``micro_steps`` micro-batches (``make_inputs(micro, rank, micro_batch)``: token_inputs'
    rows by default) through ``engine``, under a GatheredMemory probe; returns (the probe,
    closed; the loss per micro-batch; the bytes gathered after each backward)."""
    from deepspeed.accelerator import get_accelerator

    from tests.unit.zero_state import GatheredMemory

    memory = GatheredMemory(engine.module)
    device = get_accelerator().current_device_name()
    losses, after_backward = [], []
    try:
        for micro in range(micro_steps):
            inputs = make_inputs(micro, torch.distributed.get_rank(), micro_batch)
            loss = engine(**{key: value.to(device) for key, value in inputs.items()}).loss
            engine.backward(loss)
            after_backward.append(memory.after_backward())
            engine.step()
            losses.append(loss.item())
    finally:
        memory.close()
    return memory, losses, after_backward


def assert_flat_within_one_unit(runs, depths, micro_steps: int, unit: str, label: str) -> None:
    """The measured runs' contract: ``runs[kind, layers]`` (train_measured's results, kind "no
    checkpoint" or "ours") at each of ``depths``. For ours: nothing gathered after any backward,
    the frozen peak at most one unit's frozen bytes (``runs[...][unit]``: a layer, an MoE block)
    beyond the no-checkpoint run's, the same losses, and the same peak at every depth."""
    for layers in depths:
        plain, ours = runs["no checkpoint", layers], runs["ours", layers]
        where = f"{label} at {layers} layers"
        assert ours["after_backward"] == [0] * micro_steps, \
            f"{where}: bytes gathered after backward {ours['after_backward']}"
        bound = plain["peak_frozen"] + ours[unit]
        assert ours["peak_frozen"] <= bound, f"{where}: frozen peak {ours['peak_frozen']} B > {bound} B " \
            f"(no-checkpoint peak {plain['peak_frozen']} + one unit's frozen {ours[unit]} B, {unit})"
        for got, expected in zip(ours["losses"], plain["losses"]):
            assert abs(got - expected) <= 1e-5 * max(1.0, abs(expected)), \
                f"{where}: losses {ours['losses']}, no-checkpoint run {plain['losses']}"
    peaks = {layers: runs["ours", layers]["peak_frozen"] for layers in depths}
    assert len(set(peaks.values())) == 1, f"{label}: the frozen peak grows with depth: {peaks}"


def assert_moved_as_reference(values: Dict[str, torch.Tensor], reference_values, atol: float,
                              rtol: float = 1e-3) -> None:
    """Each trainable param moved as in the reference run (reference_run's (initial, final)
    values): under SGD, its gradients summed over the steps."""
    assert values.keys() == reference_values.keys(), f"trainable params {sorted(values)} vs {sorted(reference_values)}"
    for name, (initial, final) in reference_values.items():
        moved, expected_move = values[name] - initial, final - initial
        assert expected_move.abs().max() > 0, f"{name} did not move in the reference: the check would be empty"
        torch.testing.assert_close(moved, expected_move.to(moved.dtype), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: how far SGD moved it, Trainer vs reference: {m}")


class ReleasedAfterEveryStep:
    """A TrainerCallback (duck-typed: the Trainer calls what it finds) that checks, at the end of
    each optimizer step, that nothing non-persistent is left gathered; not at the end of the steps
    (global_step, from 1) in ``unchecked``: a step whose backward raised, whose clean-up runs
    before the next forward gathers anything (lifecycle NOTE, rule 4)."""

    def __init__(self, unchecked=frozenset()):
        self.steps = 0
        self.unchecked = frozenset(unchecked)

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        from tests.unit.zero_state import assert_all_released

        if state.global_step not in self.unchecked:
            assert_all_released(model, f"after step {state.global_step}")
        self.steps += 1


def _default_build(use_reentrant: bool, input_require_grads: bool):
    return build_lora_llama(use_reentrant=use_reentrant, input_require_grads=input_require_grads)


def gather_batches(recorder: RecordingCollator) -> List[List[Dict[str, torch.Tensor]]]:
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, recorder.batches)
    return gathered


def word_tokenizer():
    """An offline tokenizer over the model's vocabulary (TRL wants a processing class)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({f"t{index}": index for index in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    # No token_type_ids: a Llama takes none, and TRL 0.24's GRPO hands the tokenizer's output to generate().
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token=f"t{VOCAB - 1}",
                                   eos_token=f"t{VOCAB - 2}", model_input_names=["input_ids", "attention_mask"])
