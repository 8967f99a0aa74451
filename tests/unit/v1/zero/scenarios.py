"""The recompute scenario matrix: each way a user reaches ZeRO-3 + checkpointing + frozen params.

A Scenario says how to build the model, what to put in the config, which training procedure
to run (procedures.py), what a deepspeed version must have to express it, and what stock
deepspeed does there with zero3_recompute switched off. test_recompute_scenarios.py runs each
one with the package and, separately, on stock deepspeed, and checks that stock still behaves
as recorded here; docs/scenarios.md is the same table for people.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from zero3_recompute.testing.frozen_blocks import FrozenNormLinear
from tests.unit.v1.zero import scenario_models as models
from tests.unit.v1.zero.scenario_models import perturb_frozen

Version = Tuple[int, int, int]

# Stock outcomes.
OK = "ok"
CRASH = "crash"  # CheckpointError, or another exception in backward
LEAK = "leak"  # trains, but params stay gathered after backward, or the coordinator's count of them is off
UPSTREAM = (0, 19, 3)


def crash_until_upstream(version: Version) -> str:
    """The seed bug: every patched release crashes; deepspeed's own handling trains."""
    return CRASH if version < UPSTREAM else OK


def leak_until_upstream(version: Version) -> str:
    """A module fed a no-grad input never gets its backward release; stock keeps its params
    gathered until step(). deepspeed 0.19.3 releases them when backward ends."""
    return LEAK if version < UPSTREAM else OK


def crash_then_count_leak(version: Version) -> str:
    """A backward that raises: stock 0.14.5-0.19.2 crash on the seed bug first. deepspeed's own
    handling trains on, but releases what the aborted backward left only after the next
    forward reset the coordinator's available-params count, which goes negative (and
    inflates that step's prefetch budget)."""
    return CRASH if version < UPSTREAM else LEAK


def always(outcome: str) -> Callable[[Version], str]:
    return lambda version: outcome


@dataclass(frozen=True)
class Scenario:
    name: str
    group: str
    summary: str
    build: Callable[[], torch.nn.Module]
    stock: Callable[[Version], str] = crash_until_upstream
    procedure: str = "train"
    zero: Dict = field(default_factory=dict)
    config: Dict = field(default_factory=dict)
    tokens: bool = False
    input_grad: bool = True
    gas: int = 1
    dtype: torch.dtype = torch.float32
    zero_init: bool = False
    early_stop: bool = True
    leaf_classes: Tuple[type, ...] = ()
    register_external: bool = False
    # Runs deepspeed's own checkpoint API, which constructs an accelerator Stream that the CPU
    # accelerator does not have before 0.19.8 (procedures.stream_stand_in gives it one).
    needs_stream: bool = False
    # Returns why this deepspeed/accelerator cannot express the scenario, or None.
    unavailable: Callable[[], Optional[str]] = lambda: None
    # Returns why test_with_policy leaves keep and release out here, or None.
    other_policies_unavailable: Callable[[], Optional[str]] = lambda: None
    # Where deepspeed's own handling (>= 0.19.3) is known to fail, why; the package leaves
    # those releases to deepspeed.
    upstream_fails: Optional[str] = None
    # What stock deepspeed before 0.19.3 does on a torch whose checkpoint stores a detached alias
    # of every tensor (torch 2.4; zero3_recompute.torch_recompute): no CheckpointError, since
    # the alias keeps the gathered storage; a leak where a block's backward release never
    # fires. Measured on torch 2.4.1 with deepspeed 0.14.5.
    stock_on_detaching_torch: str = OK


def seeded(factory: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:

    def build():
        torch.manual_seed(0)
        return perturb_frozen(factory())

    return build


def blocks(count: int = 2, block=FrozenNormLinear):
    return [block(models.DIM) for _ in range(count)]


def chain(wrap, count: int = 2, block=FrozenNormLinear):
    return seeded(lambda: models.Chain(blocks(count, block), wrap))


NON_REENTRANT = models.torch_checkpoint(False)
REENTRANT = models.torch_checkpoint(True)


def _deepspeed_version() -> Version:
    import deepspeed

    from zero3_recompute.versions import parse

    return parse(deepspeed.__version__)


def no_fast_leaf_sharding() -> Optional[str]:
    from deepspeed.accelerator import get_accelerator

    version = '.'.join(map(str, _deepspeed_version()))
    if _deepspeed_version() < (0, 16, 0):
        return f"deepspeed {version} has no stage3_module_granularity_threshold (the fast leaf-sharding path)"
    if _deepspeed_version() < (0, 18, 0) and get_accelerator().device_name() == "cpu":
        return (f"deepspeed {version}'s fast leaf-sharding release calls torch.empty(device=current_device()), "
                "which fails on the CPU accelerator (Invalid device string); fixed in 0.18")
    return None


def _no_per_call_early_stop() -> Optional[str]:
    import inspect

    if "early_stop" not in inspect.signature(torch.utils.checkpoint.checkpoint).parameters:
        return f"torch {torch.__version__}'s checkpoint() takes no early_stop argument (torch 2.13 on)"
    return None


def _no_selective_checkpoint() -> Optional[str]:
    if not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        return f"torch {torch.__version__} has no create_selective_checkpoint_contexts (torch 2.5 on)"
    return None


def _no_fp16() -> Optional[str]:
    """fp16 runs where the accelerator says so, and on CPU where torch's own half kernels do
    (deepspeed's CPU accelerator only asks mkldnn; procedures.fp16_allowed vouches for torch)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported() or get_accelerator().device_name() == "cpu":
        return None
    return f"the {get_accelerator().device_name()} accelerator reports no fp16 support"


EARLY_STOP_UPSTREAM = ("with early stop off the recompute runs to the end of the module whose backward triggered "
                       "it, and deepspeed's own handling lets that forward release cancel the backward's fetch: "
                       "the params it is about to use are partitioned (size-0 tensor, or CheckpointError for a "
                       "frozen-only module, its own owner); see docs/how-it-works.md on deepspeed's own handling")

SCENARIOS = [
    # Checkpoint APIs.
    Scenario("torch_non_reentrant", "checkpoint API", "torch.utils.checkpoint, use_reentrant=False",
             chain(NON_REENTRANT)),
    Scenario("torch_reentrant", "checkpoint API", "torch.utils.checkpoint, use_reentrant=True, input requires grad",
             chain(REENTRANT), stock=always(OK), stock_on_detaching_torch=OK),
    Scenario("torch_reentrant_no_input_grad", "checkpoint API",
             "use_reentrant=True; the first block's input needs no grad (its params get none, as in "
             "torch), a plain trainable block, then a block whose input does",
             seeded(lambda: models.Chain(blocks(3), REENTRANT, wraps=[REENTRANT, models.no_checkpoint, REENTRANT])),
             stock=leak_until_upstream, input_grad=False, stock_on_detaching_torch=LEAK),
    Scenario("torch_checkpoint_of_forward", "checkpoint API",
             "checkpoint(block.forward): the block's own ZeRO hooks run outside the checkpoint",
             chain(models.torch_checkpoint_of_forward(False))),
    Scenario("deepspeed_checkpoint", "checkpoint API", "deepspeed.checkpointing.checkpoint (reentrant)",
             chain(models.deepspeed_checkpoint), stock=always(OK), needs_stream=True),
    Scenario("deepspeed_non_reentrant_checkpoint", "checkpoint API",
             "deepspeed.checkpointing.non_reentrant_checkpoint (DeepSpeed #4595)",
             chain(models.deepspeed_non_reentrant_checkpoint),
             needs_stream=True, stock_on_detaching_torch=CRASH,
             upstream_fails="deepspeed's own handling does not cover its own non_reentrant_checkpoint (DeepSpeed #4595)"),
    Scenario("selective_checkpoint", "checkpoint API",
             "selective activation checkpointing: context_fn=create_selective_checkpoint_contexts, matmul "
             "outputs saved, the rest recomputed", chain(models.torch_selective_checkpoint),
             unavailable=_no_selective_checkpoint),
    # Early stop.
    Scenario("early_stop_off", "early stop", "set_checkpoint_early_stop(False)", chain(NON_REENTRANT),
             early_stop=False, stock=always(CRASH), upstream_fails=EARLY_STOP_UPSTREAM, stock_on_detaching_torch=CRASH),
    Scenario("early_stop_off_frozen_last", "early stop",
             "early stop off; the block ends in a frozen-only LayerNorm whose own backward triggers the recompute",
             chain(NON_REENTRANT, block=models.TrainableThenFrozenNorm), early_stop=False,
             stock=always(CRASH), upstream_fails=EARLY_STOP_UPSTREAM),
    Scenario("early_stop_off_per_call", "early stop", "checkpoint(..., early_stop=False) per call (torch 2.13 on)",
             chain(models.torch_checkpoint_early_stop_off), stock=always(CRASH), upstream_fails=EARLY_STOP_UPSTREAM,
             unavailable=_no_per_call_early_stop, stock_on_detaching_torch=CRASH),
    # Structure.
    Scenario("nested_checkpoints", "structure", "checkpointed pairs of checkpointed blocks (non-reentrant in both)",
             seeded(lambda: models.Chain([models.NestedPair(NON_REENTRANT)], NON_REENTRANT))),
    Scenario("nested_mixed", "structure", "reentrant outer checkpoint around non-reentrant inner ones",
             seeded(lambda: models.Chain([models.NestedPair(NON_REENTRANT)], REENTRANT))),
    Scenario("called_twice", "structure", "one block applied twice in a forward",
             seeded(lambda: models.Chain([models.SharedTwice()], NON_REENTRANT)), stock_on_detaching_torch=LEAK),
    Scenario("recursive", "structure", "a module that calls itself",
             seeded(lambda: models.Chain([models.Recursive()], NON_REENTRANT)), stock_on_detaching_torch=LEAK),
    Scenario("keyword_only_call", "structure", "submodules called with keyword arguments only (as Llama's self_attn)",
             seeded(lambda: models.Chain([models.KeywordOnly(), models.KeywordOnly()], NON_REENTRANT))),
    Scenario("tied_frozen_weights", "structure", "frozen embedding tied to the output head, head checkpointed too",
             seeded(lambda: models.TokenModel(blocks(), NON_REENTRANT, tie_head=True)), tokens=True, stock_on_detaching_torch=LEAK),
    Scenario("external_params", "structure", "a frozen weight used by another module (register_external_parameter)",
             seeded(lambda: models.Chain([models.Gated(), models.Gated()], NON_REENTRANT)), register_external=True),
    Scenario("z3_leaf_modules", "structure",
             "checkpointed pairs of blocks, the blocks marked with deepspeed.utils.set_z3_leaf_modules",
             chain(NON_REENTRANT, block=models.pair), leaf_classes=(FrozenNormLinear, )),
    Scenario("z3_leaf_fast_sharding", "structure",
             "leaf modules chosen by stage3_module_granularity_threshold (fast leaf sharding)",
             seeded(lambda: models.WideTop(blocks(block=models.pair), NON_REENTRANT)), procedure="fast_leaf",
             zero={"stage3_module_granularity_threshold": 150}, unavailable=no_fast_leaf_sharding,
             upstream_fails=("deepspeed's own handling keeps the fast leaf path's release, which swaps param.data "
                             "for a 1-element buffer: CheckpointError, recomputed shape [1]")),
    Scenario("zero_init", "structure", "model built under deepspeed.zero.Init (ZeRO's memory-efficient linear)",
             chain(NON_REENTRANT, block=models.FrozenSandwich), zero_init=True),
    # No-grad input.
    Scenario("no_grad_input_accumulation", "no-grad input",
             "frozen embedding feeds the blocks, no enable_input_require_grads; gradient accumulation 2",
             seeded(lambda: models.TokenModel(blocks(), NON_REENTRANT, tie_head=False)), tokens=True, gas=2,
             procedure="accumulation", stock_on_detaching_torch=LEAK),
    # Precision.
    Scenario("bf16", "precision", "bf16 mixed precision", chain(NON_REENTRANT), dtype=torch.bfloat16,
             config={"bf16": {"enabled": True}}),
    Scenario("fp16_overflow", "precision", "fp16 with dynamic loss scaling; one step overflows and is skipped",
             chain(NON_REENTRANT), dtype=torch.float16, procedure="fp16_overflow", unavailable=_no_fp16,
             config={"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}}),
    # ZeRO-3 knobs.
    Scenario("persistent_frozen", "ZeRO-3 knobs",
             "stage3_param_persistence_threshold 100: narrow frozen norms stay resident, wide ones are partitioned",
             chain(NON_REENTRANT, block=models.TwoNormBlock), procedure="persistent",
             zero={"stage3_param_persistence_threshold": 100}),
    Scenario("prefetch_defaults", "ZeRO-3 knobs", "default prefetch bucket and max reuse distance",
             chain(NON_REENTRANT, count=3), zero={"stage3_prefetch_bucket_size": 50_000_000,
                                                 "stage3_max_reuse_distance": 1_000_000_000}),
    Scenario("offload_param_cpu", "ZeRO-3 knobs", "offload_param to CPU", chain(NON_REENTRANT),
             zero={"offload_param": {"device": "cpu", "pin_memory": False}}),
    # Interleaving.
    Scenario("eval_and_generation_between_steps", "interleaving",
             "eval forward and a torch.no_grad() generation loop between training steps", chain(NON_REENTRANT),
             procedure="interleave"),
    # Faults.
    Scenario("fault_in_recompute", "faults", "an exception raised inside the first recompute of a backward",
             chain(NON_REENTRANT, block=models.FaultyBlock), procedure="fault_first_recompute",
             stock=crash_then_count_leak),
    Scenario("fault_with_root_params", "faults",
             "an exception raised inside the first recompute of a backward, in a model whose root has a param",
             seeded(lambda: models.GainedChain(blocks(2, models.FaultyBlock), NON_REENTRANT)),
             procedure="fault_first_recompute", stock=crash_then_count_leak),
    Scenario("backward_aborted_halfway", "faults",
             "an exception in the second recompute of a backward, after a frozen block's backward completed",
             seeded(lambda: models.Chain([models.FaultyBlock(), models.FrozenBlock()], NON_REENTRANT)),
             procedure="fault_halfway",
             stock=crash_then_count_leak),
    Scenario("fault_then_eval", "faults",
             "an exception raised inside the first recompute of a backward, then an eval forward and a "
             "no-grad generation loop before training resumes",
             chain(NON_REENTRANT, block=models.FaultyBlock), procedure="fault_then_eval",
             # On torch 2.4 stock trains through the fault, and the eval finds what the aborted
             # backward left gathered.
             stock=crash_then_count_leak, stock_on_detaching_torch=LEAK),
]

BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}


def expected_stock(scenario: Scenario, version: Version, upstream_installed: bool,
                   torch_keeps_frozen: bool = True) -> str:
    """What deepspeed without the package does: stock's recorded outcome, or a crash where
    deepspeed's own handling (0.19.3 on) is installed and known to fail the scenario.
    ``torch_keeps_frozen``: the installed torch's checkpoint stores a frozen tensor itself
    (torch 2.5 on; zero3_recompute.torch_recompute), not a detached alias (torch 2.4)."""
    if upstream_installed and scenario.upstream_fails:
        return CRASH
    if not torch_keeps_frozen and not upstream_installed:
        return scenario.stock_on_detaching_torch
    return scenario.stock(version)
