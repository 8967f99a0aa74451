"""QLoRA under ZeRO-3, 2 ranks: transformers' Trainer on a bitsandbytes 4-bit NF4 Llama loaded with
from_pretrained (quantized_llama.py), PEFT LoRA, with the package active as pip install leaves it.

- Trained non-reentrant and reentrant, with the persistence threshold at 0 and at the HF
  default: the logged loss per step and how far each LoRA param moved under SGD match a run of
  the same 4-bit model without ZeRO on the same batches; the checkpoint mode that trained is
  the one asked for; after every step no non-persistent ZeRO-3 param is left gathered.
- The live storage of the frozen 4-bit weights during backward (GatheredMemory's
  peak_backward_live_frozen: storage seen under a gathered param, alive until freed, whoever
  holds it) at 2 and 8 layers, per configuration: flat in depth under the package, within one
  layer of stock reentrant's; see test_live_storage_table.

Select with ``-m hf``. In CI they run in the two-version lane (tests/unit/lanes.py): the canary
on deepspeed 0.19.2 and 0.19.8, the trainings paired (0.19.8 with transformers 5, 0.19.2 with
transformers 4.57), the live-storage table on 0.19.8 (the README's figures; the mechanism, a
gathered view kept on ctx, is test_context_kept_views' on every cell); ZERO3_FULL_LANES=1 runs them
on any deepspeed and stack.
"""
import pytest

from tests.unit.common import DistributedTest

LOSS_TOLERANCE = 2e-3  # the Trainer logs losses rounded to 4 decimals
DEPTHS = (2, 8)


def _qlora_trainer_run(folder: str, use_reentrant: bool, persistence_threshold):
    from transformers import Trainer, default_data_collator

    from tests.integration.hf_runs import (RecordingCollator, ReleasedAfterEveryStep, dataset_rows, reset_accelerate,
                                           training_arguments)
    from tests.integration.quantized_llama import load_qlora
    from zero3_recompute.testing.llama_lora import TokenDataset, trainer_class, trainer_zero3_config

    reset_accelerate()
    config = trainer_zero3_config()
    config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence_threshold
    args = training_arguments(use_reentrant, config)  # builds the ZeRO-3 config from_pretrained reads
    model = load_qlora(folder, use_reentrant=None, input_require_grads=use_reentrant)
    recorder = RecordingCollator(default_data_collator)
    released = ReleasedAfterEveryStep()
    trainer = trainer_class(Trainer)(model=model, args=args, train_dataset=TokenDataset(dataset_rows(64)),
                                     data_collator=recorder, callbacks=[released])
    trainer.train()
    return trainer, recorder, released


@pytest.mark.hf
class TestQLoRA(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.lane(paired=True)
    @pytest.mark.parametrize("persistence_threshold", [0, "auto"], ids=["persist_0", "persist_hf_default"])
    @pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
    def test_trainer_qlora(self, use_reentrant, persistence_threshold):
        import torch

        import zero3_recompute
        from tests.integration.hf_runs import (STEPS, assert_moved_as_reference, checkpoint_modes, gather_batches,
                                               logged_losses, reference_run, require_hf_stack,
                                               trainable_values)
        from tests.integration.quantized_llama import load_qlora, require_bitsandbytes, save_tiny_llama
        from tests.unit.zero_state import zero3_params

        require_hf_stack()
        require_bitsandbytes()
        if not use_reentrant and not zero3_recompute.status().fixed:
            pytest.xfail("stock deepspeed 0.14.5-0.19.2 raises CheckpointError here (ZERO3_RECOMPUTE_DISABLE set?)")
        folder = save_tiny_llama(2)
        trainer, recorder, released = _qlora_trainer_run(folder, use_reentrant, persistence_threshold)
        model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
        quantized = [param for param in zero3_params(model) if type(param).__name__ == "Params4bit"]
        assert quantized, "no 4-bit weight is under ZeRO-3: the test would not cover QLoRA"
        assert checkpoint_modes(model) == {use_reentrant}, \
            f"trained with use_reentrant {checkpoint_modes(model)}, expected {use_reentrant}"
        assert released.steps == STEPS, f"checked after {released.steps} steps of {STEPS}"
        losses = logged_losses(trainer)
        assert len(losses) == STEPS, f"expected {STEPS} logged losses, got {losses}"

        def build(use_reentrant, input_require_grads):
            return load_qlora(folder, use_reentrant, input_require_grads)

        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # the reference loads without ZeRO
        expected, reference_values = reference_run(gather_batches(recorder), STEPS, use_reentrant, use_reentrant,
                                                   build=build)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=0, atol=LOSS_TOLERANCE,
                                   msg=lambda m: f"Trainer losses {losses} vs the 4-bit reference {expected}: {m}")
        assert_moved_as_reference(trainable_values(model), reference_values, atol=1e-6)

    @pytest.mark.lane
    def test_stock_crashes_without_patch(self):
        """The canary: with the patch reverted, the non-reentrant QLoRA run dies in backward with
        the crash the package fixes."""
        from tests.integration.hf_runs import require_hf_stack
        from tests.integration.quantized_llama import require_bitsandbytes, save_tiny_llama
        from tests.unit.patch_switch import assert_stock_crashes, patch_reverted

        require_hf_stack()
        require_bitsandbytes()

        def train_on_stock():
            folder = save_tiny_llama(2)
            with patch_reverted():
                _qlora_trainer_run(folder, use_reentrant=False, persistence_threshold=0)

        assert_stock_crashes(train_on_stock)


def measure_live_storage(folder: str, use_reentrant, policy: str, steps: int = 2) -> dict:
    """Trains the 4-bit LoRA Llama from ``folder`` ``steps`` steps with a plain deepspeed.initialize
    loop (prefetch, reuse distance and persistence threshold 0: exact bytes) under ``policy`` (or
    "stock", the patch reverted); returns the peak live storage of frozen params during backward,
    the peak of frozen bytes gathered, the losses and one layer's frozen 4-bit bytes."""
    import deepspeed
    import torch
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    from tests.integration.hf_runs import exact_bytes_config, train_measured
    from tests.integration.quantized_llama import load_qlora
    from tests.unit.patch_switch import patch_reverted, policy_in_force

    config = exact_bytes_config(2)
    config["zero_allow_untested_optimizer"] = True
    with patch_reverted() if policy == "stock" else policy_in_force(policy):
        in_force = HfDeepSpeedConfig(config)  # from_pretrained loads partitioned while it lives
        model = load_qlora(folder, use_reentrant, input_require_grads=bool(use_reentrant))
        model.train()  # from_pretrained returns it in eval mode, where transformers checkpoints nothing
        optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=0.1)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        del in_force
        memory, losses, _ = train_measured(engine, steps, 2)
    layer = next(module for module in engine.module.modules() if type(module).__name__ == "LlamaDecoderLayer")
    layer_bytes = sum(param.ds_numel * param.element_size() for param in layer.parameters()
                      if type(param).__name__ == "Params4bit")
    return {"live_frozen": memory.peak_backward_live_frozen, "gathered_frozen": memory.peak_backward_frozen,
            "losses": losses, "layer_4bit": layer_bytes}


# (label, use_reentrant, policy) of each configuration of the live-storage table.
CONFIGURATIONS = (
    ("no checkpointing", None, "auto"),
    ("stock, reentrant", True, "stock"),
    ("package auto, reentrant", True, "auto"),
    ("package auto, non-reentrant", False, "auto"),
    ("package keep, non-reentrant", False, "keep"),
    ("package release, non-reentrant", False, "release"),
)


@pytest.mark.hf
class TestQLoRALiveStorage(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.lane(newest_only=True)
    def test_live_storage_table(self):
        """The live storage of frozen 4-bit weights during backward at 2 and 8 layers, per
        configuration (printed as a table: README, docs/policies-and-memory.md). bitsandbytes
        keeps each layer's gathered weight on its autograd ctx: under non-reentrant checkpointing
        that ctx is the original forward's, alive until backward, so on its own the live storage
        would grow with depth, as without checkpointing; the package frees that storage in place
        at the release and refills it at the next fetch (NOTE [ Gathered storage kept outside
        saved tensors ]). Checked: every configuration's losses equal the no-checkpoint run's;
        under the package, the frozen bytes gathered (status AVAILABLE) and the live storage are
        flat in depth, under both checkpointing kinds and every policy. Mutations: holds never
        dropped (HoldRegistry.drop a no-op) fail the gathered check at 8 layers; the free left out
        (KeptStorage.after_release keeps every storage) fails the live check under
        non-reentrant checkpointing."""
        import zero3_recompute
        from tests.integration.hf_runs import require_hf_stack
        from tests.integration.quantized_llama import require_bitsandbytes, save_tiny_llama

        require_hf_stack()
        require_bitsandbytes()
        status = zero3_recompute.status()
        if status.mode == "upstream" or not status.fixed:
            pytest.skip(f"the package is not in charge here: {status}")
        runs = {}
        for layers in DEPTHS:
            folder = save_tiny_llama(layers)
            for label, use_reentrant, policy in CONFIGURATIONS:  # stock runs reentrant only: it trains there
                runs[label, layers] = measure_live_storage(folder, use_reentrant, policy)
        lines = ["| configuration | " + " | ".join(f"live frozen at {layers} layers (B)" for layers in DEPTHS)
                 + " | gathered frozen peak (B) |", "|---|" + "---|" * (len(DEPTHS) + 1)]
        for label, _, _ in CONFIGURATIONS:
            lines.append(f"| {label} | " + " | ".join(str(runs[label, layers]["live_frozen"]) for layers in DEPTHS)
                         + " | " + " / ".join(str(runs[label, layers]["gathered_frozen"]) for layers in DEPTHS) + " |")
        layer = runs["no checkpointing", DEPTHS[0]]["layer_4bit"]
        print(f"\nQLoRA live storage of frozen 4-bit weights during backward (one layer's 4-bit weights: {layer} B)\n"
              + "\n".join(lines))
        for (label, layers), run in runs.items():
            expected = runs["no checkpointing", layers]["losses"]
            assert all(abs(got - want) <= 1e-4 * max(1.0, abs(want)) for got, want in zip(run["losses"], expected)), \
                f"{label} at {layers} layers: losses {run['losses']}, no checkpointing {expected}"
        for label, use_reentrant, policy in CONFIGURATIONS:
            if policy == "stock" or use_reentrant is None:
                continue
            shallow, deep = (runs[label, layers] for layers in DEPTHS)
            assert shallow["gathered_frozen"] == deep["gathered_frozen"], \
                f"{label}: frozen bytes gathered in backward grow with depth: {shallow['gathered_frozen']} B at " \
                f"{DEPTHS[0]} layers, {deep['gathered_frozen']} B at {DEPTHS[1]}"
            assert shallow["live_frozen"] == deep["live_frozen"], \
                f"{label}: live frozen storage grows with depth: {shallow['live_frozen']} B at {DEPTHS[0]} layers, " \
                f"{deep['live_frozen']} B at {DEPTHS[1]}"
            for layers in DEPTHS:
                bound = runs["stock, reentrant", layers]["live_frozen"] + layer
                assert runs[label, layers]["live_frozen"] <= bound, \
                    f"{label} at {layers} layers: live frozen {runs[label, layers]['live_frozen']} B > stock " \
                    f"reentrant's + one layer, {bound} B"
