"""transformers', PEFT's and deepspeed's other ways into a checkpoint, each as a user's script takes
it: a tiny Llama saved, loaded in bf16 with from_pretrained under ZeRO-3 (zero.Init), wrapped by
PEFT, checkpointed non-reentrant, and trained through a bf16 ZeRO-3 engine under HF's "auto"
values (deepspeed's prefetch on). PATHS says what each one changes.
"""
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from zero3_recompute.testing.llama_lora import token_batch

LAYERS = 4
MICRO_BATCH = 2
STEPS = 3
LR = 0.5  # plain SGD: a param's move is its summed gradients times this


def _lora(**extra):
    def adapter():
        from peft import LoraConfig

        return LoraConfig(task_type="CAUSAL_LM", **extra)

    return adapter


def _prompt_tuning():
    from peft import PromptTuningConfig

    return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


def _enable(**options):
    """Non-reentrant checkpointing through transformers, with ``options`` (every_n_layers, offload)."""

    def enable(model) -> None:
        kwargs = {"use_reentrant": False}
        if options:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    return enable


@contextlib.contextmanager
def _unpinned_offload():
    """transformers' offload=True saves activations under save_on_cpu(pin_memory=True), which a
    torch without an accelerator cannot pin: there the same hook, unpinned (pinning changes how
    fast a copy goes, not what is saved)."""
    import transformers.modeling_utils as modeling

    if torch.cuda.is_available():
        yield
        return
    original = modeling.save_on_cpu
    modeling.save_on_cpu = lambda pin_memory=False, **kwargs: original(pin_memory=False, **kwargs)
    try:
        yield
    finally:
        modeling.save_on_cpu = original


def _hidden_states_offload():
    """deepspeed 0.19.8's outer saved-tensors hook over transformers' checkpointed layers; every
    marked hidden state offloaded (on a CPU they stay where they are, counted as skipped)."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    return CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)


def _no_every_n_layers() -> Optional[str]:
    import inspect

    import transformers

    enable = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
    if enable is None or "every_n_layers" not in inspect.signature(enable).parameters:
        return f"transformers {transformers.__version__} has no activation_checkpointing_enable(every_n_layers, offload)"
    return None


def _no_hidden_states_offload() -> Optional[str]:
    try:
        from deepspeed.runtime.activation_checkpointing.offload_activations import \
            CheckpointHiddenStatesOffload  # noqa: F401
    except ImportError:
        import deepspeed

        return f"deepspeed {deepspeed.__version__} has no CheckpointHiddenStatesOffload (0.19.8 on)"
    return _no_every_n_layers()  # it marks the calls of transformers 5's checkpointed layers


def _modules_to_save_fails_on_stock() -> Optional[str]:
    """deepspeed before 0.19.3 fails modules_to_save without any checkpoint: PEFT's copy of a module
    is called with hooks deepspeed never counted for it (ds_grads_remaining, fixed by 0.19.3's
    _register_deepspeed_module)."""
    import deepspeed
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version("0.19.3"):
        return (f"deepspeed {deepspeed.__version__} fails modules_to_save without checkpointing too "
                "(AttributeError: no attribute 'ds_grads_remaining'; fixed in 0.19.3)")
    return None


@dataclass(frozen=True)
class CheckpointPath:
    summary: str
    adapter: Callable = field(default=_lora())
    enable: Callable = field(default=_enable())
    # Around building the checkpointed run's model and its training (a hook in force, a shim).
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # Around each checkpointed step's forward and backward.
    around_step: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    unavailable: Callable[[], Optional[str]] = lambda: None
    # PEFT's default, fp32 adapters; False keeps every trainable param bf16, where deepspeed cannot
    # take two dtypes among them (its defragment assert, docs/known-crashes.md).
    fp32_adapters: bool = True


PATHS: Dict[str, CheckpointPath] = {
    "every_n_layers": CheckpointPath("every second layer checkpointed, the others plain (transformers' every_n_layers=2)",
                                     enable=_enable(every_n_layers=2), unavailable=_no_every_n_layers),
    "offload": CheckpointPath("each checkpoint's saved inputs under save_on_cpu (transformers' offload=True)",
                              enable=_enable(offload=True), around=_unpinned_offload, unavailable=_no_every_n_layers),
    "hidden_states_offload": CheckpointPath("deepspeed's CheckpointHiddenStatesOffload around forward and backward",
                                            around_step=_hidden_states_offload,
                                            unavailable=_no_hidden_states_offload),
    "dora": CheckpointPath("PEFT's DoRA: the base weight read outside the base layer's forward (its norm)",
                           adapter=_lora(use_dora=True)),
    "prompt_tuning": CheckpointPath("PEFT's prompt tuning: every param in the checkpointed layers frozen",
                                    adapter=_prompt_tuning),
    "modules_to_save": CheckpointPath("PEFT's modules_to_save: a trainable copy of each layer's input norm and of "
                                      "the head, beside the frozen originals, all bf16",
                                      adapter=_lora(modules_to_save=["input_layernorm", "lm_head"]), fp32_adapters=False,
                                      unavailable=_modules_to_save_fails_on_stock),
}


def save_tiny_llama(directory: str) -> None:
    """Rank 0 saves a seeded tiny Llama of LAYERS layers (fp32) for from_pretrained; every rank waits."""
    from tests.integration.hf_runs import build_outside_zero3
    from zero3_recompute.testing.llama_lora import build_base_llama

    if torch.distributed.get_rank() == 0:
        build_outside_zero3(build_base_llama, layers=LAYERS).save_pretrained(directory)
    torch.distributed.barrier()


def zero3_config() -> dict:
    """hf_families' ZeRO-3 config (HF's "auto" values for this size, deepspeed's prefetch), in bf16."""
    from tests.integration.hf_families import zero3_config as families_config

    return dict(families_config(), bf16={"enabled": True})


def run(name: str, directory: str, checkpointing: bool, steps: int = STEPS):
    """The path's model through a bf16 ZeRO-3 engine, checkpointed its way or not at all: (the mean
    loss per step, how far each trainable param's fp32 master moved: a bf16 param rounds a small
    move away); nothing non-persistent gathered after any step."""
    import deepspeed
    from peft import get_peft_model
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from tests.integration.hf_runs import trainable_masters
    from tests.unit.zero_state import assert_all_released, zero3_params

    path = PATHS[name]
    config = zero3_config()
    with (path.around() if checkpointing else contextlib.nullcontext()):
        # While it lives, from_pretrained builds under zero.Init and PEFT gathers what it reads (DoRA's norm).
        keep_alive = HfDeepSpeedConfig(config)
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        torch.manual_seed(1)
        model = get_peft_model(model, path.adapter(), autocast_adapter_dtype=path.fp32_adapters)
        del keep_alive
        if checkpointing:
            path.enable(model)
        trainable = [param for param in model.parameters() if param.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(trainable, lr=LR),
                                               config=config)
        assert zero3_params(engine.module), f"{name}: the model is not under ZeRO-3"
        engine.train()  # from_pretrained leaves eval mode, in which transformers' layers do not checkpoint
        checkpointed = [module for module in engine.module.modules() if getattr(module, "gradient_checkpointing", False)]
        assert bool(checkpointed) is checkpointing, f"{name}: {len(checkpointed)} checkpointed layers"
        initial = trainable_masters(engine.module)
        rank, losses = torch.distributed.get_rank(), []
        for step in range(steps):
            input_ids = token_batch(step, rank, MICRO_BATCH).to(engine.device)
            around_step = path.around_step() if checkpointing else contextlib.nullcontext()
            with around_step:
                loss = engine(input_ids=input_ids, labels=input_ids).loss
                engine.backward(loss)
            marked = getattr(getattr(around_step, "stats", None), "marked_tensors", None)
            assert marked is None or marked > 0, f"{name}: the step's hook marked no checkpointed layer's input"
            engine.step()
            assert_all_released(engine.module, f"{name}, after step {step}")
            mean = loss.detach().float().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / torch.distributed.get_world_size())
        final = trainable_masters(engine.module)
    return losses, {param_name: final[param_name] - value for param_name, value in initial.items()}
