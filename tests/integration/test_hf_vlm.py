"""A LLaVA-style vision-language model under ZeRO-3, 2 ranks: transformers'
LlavaForConditionalGeneration from its config (a CLIP vision tower, a projector, a Llama language
model), the vision tower frozen, LoRA on the language model's q_proj/v_proj, the projector
trainable; non-reentrant checkpointing of the language model's layers under the package's default
policy, and once of the vision tower's layers as well. The tower is frozen and its input needs
no grad, so no backward reaches it: its checkpointed layers are the path of a checkpointed region
whose output needs no grad, which must keep nothing gathered past its forward.

At 2 and at 4 layers (of the language model and of the vision tower alike), against the run without checkpointing on stock deepspeed (the patch reverted: stock trains it):
  - the losses are equal;
  - nothing is gathered after any backward;
  - the frozen bytes gathered during backward are the same at 4 layers as at 2, and at most one
    layer's frozen params (the larger of a language and a vision layer) beyond the reference's.
Holds never dropped (HoldRegistry.drop a no-op) fail the one-layer bound.
Select with ``-m hf``; it runs in the two-version lane (tests/unit/lanes.py).
"""
import pytest

from tests.unit.common import DistributedTest

DEPTHS = (2, 4)
MICRO_STEPS = 3
MICRO_BATCH = 2
IMAGE_SIZE, PATCH = 16, 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # the "default" feature strategy drops CLIP's class token
TEXT_TOKENS = 16


def _image_token() -> int:
    from zero3_recompute.testing.llama_lora import VOCAB

    return VOCAB - 3  # below word_tokenizer's eos and pad; the text ids stay under it


def _build(layers: int, use_reentrant, vision_checkpointed: bool):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from zero3_recompute.testing.llama_lora import HIDDEN, VOCAB, enable_checkpointing

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=2 * (IMAGE_TOKENS + TEXT_TOKENS), use_cache=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=_image_token(),
                         image_seq_length=IMAGE_TOKENS, vision_feature_layer=-1)
    model = LlavaForConditionalGeneration(config)
    model.train()
    if use_reentrant is not None:
        enable_checkpointing(model.model.language_model, use_reentrant)
        if vision_checkpointed:
            enable_checkpointing(model.model.vision_tower, use_reentrant)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=r".*language_model.*\.(q_proj|v_proj)", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    for param in model.base_model.model.model.multi_modal_projector.parameters():
        param.requires_grad_(True)
    return model


def image_inputs(micro: int, rank: int, micro_batch: int) -> dict:
    """An image and its placeholder tokens, then text: input ids, pixel values and labels (none
    on the image's tokens)."""
    import torch

    from tests.integration.hf_runs import token_inputs

    text = token_inputs(micro, rank, micro_batch)["input_ids"][:, :TEXT_TOKENS] % _image_token()
    image = torch.full((micro_batch, IMAGE_TOKENS), _image_token())
    generator = torch.Generator().manual_seed(10_000 * rank + micro)
    pixels = torch.randn(micro_batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return {"input_ids": torch.cat([image, text], dim=1), "pixel_values": pixels,
            "labels": torch.cat([torch.full_like(image, -100), text], dim=1)}


def _frozen_bytes(module) -> int:
    return sum(param.ds_numel * param.element_size() for param in module.parameters() if not param.requires_grad)


def _first_layer(tower):
    """The first of ``tower``'s stacked layers (its first ModuleList), wherever the transformers
    version nests them."""
    import torch

    return next(module for module in tower.modules() if isinstance(module, torch.nn.ModuleList))[0]


def measure(layers: int, use_reentrant, vision_checkpointed: bool, policy: str) -> dict:
    """Trains the model ``MICRO_STEPS`` steps under ``policy`` ("stock": the patch reverted)."""
    import deepspeed
    import torch

    from tests.integration.hf_runs import build_outside_zero3, exact_bytes_config, train_measured
    from tests.unit.patch_switch import patch_reverted, policy_in_force

    with patch_reverted() if policy == "stock" else policy_in_force(policy):
        model = build_outside_zero3(_build, layers, use_reentrant, vision_checkpointed)
        optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=1e-2)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=exact_bytes_config(MICRO_BATCH))
        memory, losses, after_backward = train_measured(engine, MICRO_STEPS, MICRO_BATCH, make_inputs=image_inputs)
    inner = engine.module.base_model.model.model
    layer_frozen = _frozen_bytes(_first_layer(inner.language_model))
    if vision_checkpointed:
        layer_frozen = max(layer_frozen, _frozen_bytes(_first_layer(inner.vision_tower)))
    return {"losses": losses, "peak_frozen": memory.peak_backward_frozen, "after_backward": after_backward,
            "layer_frozen": layer_frozen}


@pytest.mark.hf
class TestVisionLanguage(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.lane(paired=True)
    @pytest.mark.parametrize("vision_checkpointed", [False, True], ids=["language_layers", "vision_layers_too"])
    def test_frozen_peak_flat_in_depth(self, vision_checkpointed):
        import zero3_recompute
        from tests.integration.hf_runs import assert_flat_within_one_unit, require_hf_stack

        require_hf_stack()
        status = zero3_recompute.status()
        if not status.fixed:
            pytest.skip(f"the package is not in charge here: {status}")
        runs = {}
        for layers in DEPTHS:
            runs["no checkpoint", layers] = measure(layers, None, vision_checkpointed, "stock")
            runs["ours", layers] = measure(layers, False, vision_checkpointed, "auto")
        print("\n".join(f"{label} at {layers} layers: frozen peak {run['peak_frozen']} B (one layer "
                        f"{run['layer_frozen']} B), after backward {run['after_backward']}, losses {run['losses']}"
                        for (label, layers), run in runs.items()))
        assert_flat_within_one_unit(runs, DEPTHS, MICRO_STEPS, "layer_frozen", "non-reentrant")

    @pytest.mark.lane
    def test_stock_crashes_without_patch(self):
        """The canary: with the patch reverted, the checkpointed run dies in its first backward."""
        from tests.integration.hf_runs import require_hf_stack
        from tests.unit.patch_switch import assert_stock_crashes

        require_hf_stack()
        assert_stock_crashes(lambda: measure(2, False, vision_checkpointed=False, policy="stock"))
