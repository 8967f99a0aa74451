"""A bf16 model with fp32 trainable adapters, as PEFT leaves a bf16 model (autocast_adapter_dtype=True),
under a bf16 ZeRO-3 engine: NOTE [ Mixed-dtype gathers ] (zero3_recompute.mixed_dtype_gather).

The base is built under zero.Init in bf16, the adapters after it in fp32, as from_pretrained and
get_peft_model do; small params are persistent (deepspeed's default threshold is 1e5 numel,
HF's "auto" 10 x hidden), so deepspeed gathers bf16 norms and fp32 adapters in one list after every
step. On deepspeed 0.19.2 stock raises there at the first step, with or without checkpointing;
with the package it trains as plain torch does, and every release the layer is not needed on
leaves deepspeed's method as it is.

Mutation: one_dtype_at_a_time handing the whole list to deepspeed (``runs = [param_list]``) fails
test_trains_as_plain_torch on 0.19.2 with deepspeed's own error.
"""
import pytest
import torch
import torch.nn as nn

from tests.unit.common import DistributedTest
from tests.unit.v1.zero.plain_torch import CheckpointedChain, sgd_reference

DIM = 16
RANK = 4
STEPS = 3
LR = 0.5
# bf16 keeps 8 bits of mantissa: 2**-8 relative per rounding; a few roundings apart at most.
BF16_RTOL = 4 * 2.0**-8


class _Adapted(nn.Module):
    """A frozen bf16 Linear plus a LoRA-style fp32 pair, as PEFT's Linear computes it."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def add_adapter(self):
        self.lora_a = nn.Linear(DIM, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, DIM, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)

    def forward(self, x):
        adapted = self.lora_b(self.lora_a(x.to(self.lora_a.weight.dtype)))
        return self.norm(self.base(x) + adapted.to(x.dtype))


def _model(checkpointing: bool) -> CheckpointedChain:
    return CheckpointedChain([_Adapted() for _ in range(2)], checkpointing)


def _build(checkpointing: bool, zero_init_config=None) -> CheckpointedChain:
    """The base in bf16, frozen (under zero.Init when given its config, with the plain model's
    values); then fp32 adapters, as get_peft_model adds them after from_pretrained."""
    import deepspeed

    from tests.unit.v1.zero.scenario_runner import copy_into_partitioned

    torch.manual_seed(0)
    model = _model(checkpointing).to(torch.bfloat16)
    if zero_init_config is not None:
        with deepspeed.zero.Init(config_dict_or_path=zero_init_config, dtype=torch.bfloat16):
            partitioned = _model(checkpointing)
        copy_into_partitioned(partitioned, model)
        model = partitioned
    model.requires_grad_(False)
    torch.manual_seed(1)
    for block in model.blocks:
        block.add_adapter()
    return model


def _rows(ranks: int):
    generator = torch.Generator().manual_seed(2)
    rows = 4 * ranks
    return torch.randn(rows, DIM, generator=generator).to(torch.bfloat16), torch.randn(rows, DIM, generator=generator)


def _config() -> dict:
    from tests.unit.v1.zero.scenario_runner import base_config, merge

    return merge(base_config(), {"bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
                                 # Adapters and norms persistent, the base Linear's 272 numel not.
                                 "zero_optimization": {"stage3_param_persistence_threshold": 100}})


def _train(checkpointing: bool):
    """(the mean loss per step, each adapter's fp32 master at the end, the adapters' dtype in the
    engine), ZeRO-3 on every rank; each adapter, gathered with every other param in one list, is
    its master in its own dtype."""
    import deepspeed
    import deepspeed.comm as dist

    from tests.unit.v1.zero.scenario_runner import device, local_rows, train_mean_losses

    config = _config()
    model = _build(checkpointing, config)
    dtypes = {param.dtype for param in model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}, f"the model's dtypes are {dtypes}: the premise is lost"
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x, target = (local_rows(tensor).to(device()) for tensor in _rows(dist.get_world_size()))
    losses = train_mean_losses(engine, x, target, STEPS)
    from deepspeed.utils import safe_get_full_fp32_param

    trainable = [(name, param) for name, param in engine.module.named_parameters() if param.requires_grad]
    masters = {name: safe_get_full_fp32_param(param).detach().cpu().clone() for name, param in trainable}
    # All params at once: deepspeed's list gather, the very path NOTE [ Mixed-dtype gathers ] is about.
    with deepspeed.zero.GatheredParameters([param for _, param in trainable] + list(engine.module.parameters())):
        for name, param in trainable:
            torch.testing.assert_close(param.detach().cpu(), masters[name].to(param.dtype), rtol=0, atol=0,
                                       msg=lambda m: f"{name} as a list gather returns it vs its master: {m}")
    return losses, masters, trainable[0][1].dtype


def _reference(ranks: int, trainable_dtype: torch.dtype):
    return sgd_reference(_build(checkpointing=False), _rows(ranks), STEPS, LR, trainable_dtype)


class TestMixedDtypeGather(DistributedTest):
    world_size = 2
    timeout = 240

    @pytest.mark.parametrize("checkpointing", [False, True])
    def test_trains_as_plain_torch(self, checkpointing):
        """Losses and trained adapters against plain torch with the same dtypes (the adapters in the dtype
        the engine trains them in: fp32 from 0.19.2 on, bf16 before), within bf16's precision."""
        import deepspeed.comm as dist
        import zero3_recompute

        from tests.unit.patch_switch import mixed_dtype_gather_needed

        status = zero3_recompute.status()
        if not status.active and (mixed_dtype_gather_needed() or checkpointing):
            pytest.skip(f"the package is not patched here: {status}")
        losses, values, trained_as = _train(checkpointing)
        expected_losses, expected_values = _reference(dist.get_world_size(), trained_as)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=BF16_RTOL, atol=1e-4,
                                   msg=lambda m: f"losses {losses} vs plain torch {expected_losses}: {m}")
        moved = {name: (values[name] - expected_values[name]).abs().max().item() for name in expected_values}
        for name, expected in expected_values.items():
            torch.testing.assert_close(values[name], expected, rtol=BF16_RTOL, atol=1e-3,
                                       msg=lambda m: f"{name} after {STEPS} SGD steps vs plain torch: {m} ({moved})")

    def test_stock(self):
        """Stock deepspeed: the crash where the layer is needed (the canary), and training elsewhere."""
        from tests.unit.patch_switch import is_mixed_dtype_gather_crash, mixed_dtype_gather_needed, patch_reverted

        with patch_reverted():
            if not mixed_dtype_gather_needed():
                _train(checkpointing=False)
                return
            with pytest.raises(RuntimeError) as raised:
                _train(checkpointing=False)
        assert is_mixed_dtype_gather_crash(raised.value), \
            f"stock failed otherwise than by the mixed-dtype gather: {raised.value!r}"


def test_found_where_the_code_has_it():
    """By deepspeed's code (targets.mixed_dtype_gather), the layer is needed on 0.19.2 alone of the
    matrix; the package installs it there, and only there."""
    import deepspeed
    import importlib

    import zero3_recompute
    from tests.unit.patch_switch import mixed_dtype_gather_needed
    from zero3_recompute.mixed_dtype_gather import LAYER

    importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    needed = mixed_dtype_gather_needed()
    assert needed == (deepspeed.__version__ == "0.19.2"), \
        f"deepspeed {deepspeed.__version__}: mixed-dtype gather layer needed {needed}"
    status = zero3_recompute.status()
    if status.active:
        assert (LAYER in status.layers) == needed, f"{status.layers}, needed {needed}: {status.gather_fix}"


def test_switched_off_and_reverted_leave_deepspeeds_method(monkeypatch):
    """ZERO3_RECOMPUTE_LAYERS_OFF=mixed_dtype_gather leaves deepspeed's method in place, and says so;
    revert() puts deepspeed's own back where the layer was installed."""
    import importlib

    import zero3_recompute
    from tests.unit.patch_switch import mixed_dtype_gather_needed
    from zero3_recompute.mixed_dtype_gather import LAYER
    from zero3_recompute.patch import ENV_LAYERS_OFF

    importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    from deepspeed.runtime.zero.partition_parameters import Init

    before = zero3_recompute.status()
    if not before.active:
        pytest.skip(f"the package is not patched here: {before}")
    zero3_recompute.revert()
    original = vars(Init)["_allgather_params_coalesced"]
    try:
        monkeypatch.setenv(ENV_LAYERS_OFF, LAYER)
        switched = zero3_recompute.apply(policy=before.policy)
        assert vars(Init)["_allgather_params_coalesced"] is original and LAYER not in switched.layers
        if mixed_dtype_gather_needed():
            assert switched.gather_fix.startswith("switched off"), switched.gather_fix
        zero3_recompute.revert()
        monkeypatch.delenv(ENV_LAYERS_OFF)
        installed = zero3_recompute.apply(policy=before.policy)
        assert (vars(Init)["_allgather_params_coalesced"] is not original) == mixed_dtype_gather_needed(), installed
        zero3_recompute.revert()
        assert vars(Init)["_allgather_params_coalesced"] is original, "revert() left the layer in place"
    finally:
        monkeypatch.delenv(ENV_LAYERS_OFF, raising=False)
        zero3_recompute.revert()
        zero3_recompute.apply(policy=before.policy)


class _FakePartition:
    def __init__(self, dtype, scale_dtype=None):
        self.dtype = dtype
        if scale_dtype is not None:
            self.ds_quant_scale = torch.empty(0, dtype=scale_dtype)


class _FakeParam:
    def __init__(self, name, dtype, scale_dtype=None):
        self.name = name
        self.ds_tensor = _FakePartition(dtype, scale_dtype)


def test_split_keeps_first_seen_dtype_order_and_list_order():
    """NOTE [ Mixed-dtype gathers ], rule 4: dtypes in the order the list first names them, each run in
    the list's order; the quantization scale's dtype counts only when quantized."""
    from zero3_recompute.mixed_dtype_gather import split_by_dtype

    params = [_FakeParam("a", torch.float32), _FakeParam("b", torch.bfloat16), _FakeParam("c", torch.float32),
              _FakeParam("d", torch.bfloat16, torch.float16), _FakeParam("e", torch.bfloat16, torch.float32)]
    runs = [[param.name for param in run] for run in split_by_dtype(params, quantize=False)]
    assert runs == [["a", "c"], ["b", "d", "e"]], runs
    quantized = [[param.name for param in run] for run in split_by_dtype(params, quantize=True)]
    assert quantized == [["a", "c"], ["b"], ["d"], ["e"]], quantized
    assert split_by_dtype([], quantize=False) == []
