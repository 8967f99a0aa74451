"""Train a scenario under ZeRO-3 next to a plain-torch reference, checking as it goes.

Per micro-batch: the rank's loss equals the reference's loss on the same rows, and no
non-persistent ZeRO-3 param is left gathered (or with an active submodule) after backward.
Per step: every trainable param's full gradient equals the reference's, over all ranks' rows.
After step(): nothing gathered again.
"""
import copy
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from tests.unit.lanes import lane_versions
from tests.unit.zero_state import assert_all_released

LR = 1e-3
MICRO_BATCH = 4


class Mismatch(AssertionError):
    """The ZeRO-3 run disagrees with the reference: loss or gradients."""


def rank_and_world() -> Tuple[int, int]:
    import deepspeed.comm as dist

    return dist.get_rank(), dist.get_world_size()


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


# deepspeed's own ZeRO-3 defaults for prefetch and reuse, and overlap_comm as ZeRO-3 sets it:
# what users run. base_config() turns prefetch and reuse off, so that counts and bytes are exact.
DEEPSPEED_PREFETCH = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                      "overlap_comm": True}
# The deepspeed versions whose suites also run the scenario matrix and the random trees under
# DEEPSPEED_PREFETCH: the two-version lane's (the last without deepspeed's own handling, and the
# newest); elsewhere only with ZERO3_DEEPSPEED_PREFETCH=1, to keep CI within its hour.
DEEPSPEED_PREFETCH_VERSIONS = lane_versions()


def deepspeed_prefetch_skipped() -> Optional[str]:
    """Why the DEEPSPEED_PREFETCH runs are left out here, or None where they run."""
    import os

    import deepspeed

    if os.environ.get("ZERO3_DEEPSPEED_PREFETCH") == "1" or deepspeed.__version__ in DEEPSPEED_PREFETCH_VERSIONS:
        return None
    return (f"deepspeed's default prefetch runs on {', '.join(DEEPSPEED_PREFETCH_VERSIONS)} "
            "(ZERO3_DEEPSPEED_PREFETCH=1 runs it anywhere)")


def base_config(gas: int = 1) -> dict:
    _, world_size = rank_and_world()
    return {
        "train_batch_size": MICRO_BATCH * gas * world_size,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {
            "stage": 3,
            # Tiny test params must not all count as persistent, or nothing is ever partitioned.
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
        },
        # Explicit, since deepspeed 0.19.8 changed the default to 1.0; the reference does not clip.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }


def merge(base: dict, overrides: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def make_batch(step: int, micro: int, tokens: bool, input_grad: bool, dim: int, vocab: int):
    """All ranks' rows for one micro-batch, the same on every rank: (inputs, target)."""
    _, world_size = rank_and_world()
    generator = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    rows = MICRO_BATCH * world_size
    if tokens:
        from tests.unit.v1.zero.scenario_models import SEQ

        ids = torch.randint(0, vocab, (rows, SEQ), generator=generator)
        target = torch.randint(0, vocab, (rows, SEQ), generator=generator)
        return ids, target
    x = torch.randn(rows, dim, generator=generator)
    target = torch.randn(rows, dim, generator=generator)
    return x.requires_grad_(input_grad), target


def local_rows(tensor: torch.Tensor) -> torch.Tensor:
    rank, _ = rank_and_world()
    return tensor[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]


def _to(tensor: torch.Tensor, where: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fresh leaf on ``where``; floating tensors in ``dtype``, keeping requires_grad."""
    if tensor.is_floating_point():
        return tensor.detach().to(where, dtype).requires_grad_(tensor.requires_grad)
    return tensor.to(where)


class Tolerance:
    """fp32: element-wise. bf16/fp16 run forward and backward in low precision against an fp32
    reference, so element-wise checks flag rounding on near-zero entries; there the whole
    tensor's relative error (norm of the difference over norm of the reference) is checked.
    Either way a shrunk, stale or missing weight is off by far more."""

    def __init__(self, dtype: torch.dtype, rtol: Optional[float] = None, atol: Optional[float] = None):
        self.dtype = dtype
        default_rtol, default_atol = {
            # Adam's first step turns rounding-level differences of near-zero grads into
            # lr-sized weight differences, so step 1 on carries a few 1e-6 of noise.
            torch.float32: (1e-4, 1e-5),
            torch.bfloat16: (5e-2, 1e-2),
            torch.float16: (2e-2, 5e-3),
        }[dtype]
        self.rtol = default_rtol if rtol is None else rtol
        self.atol = default_atol if atol is None else atol

    def check(self, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        actual, expected = actual.float(), expected.float()
        if self.dtype == torch.float32:
            try:
                torch.testing.assert_close(actual, expected, rtol=self.rtol, atol=self.atol)
            except AssertionError as exc:
                raise Mismatch(f"{what}: {exc}") from None
            return
        error = (actual - expected).norm().item()
        scale = expected.norm().item()
        if actual.shape != expected.shape or error > self.rtol * scale + self.atol:
            raise Mismatch(f"{what}: relative error {error / max(scale, 1e-12):.3g} (|diff| {error:.3g}, "
                           f"|expected| {scale:.3g}); allowed {self.rtol} + {self.atol} absolute")


class Run:
    """One ZeRO-3 engine and its reference, trained together."""

    def __init__(self, build: Callable[[], nn.Module], config: dict, dtype: torch.dtype = torch.float32,
                 zero_init: bool = False, after_initialize: Optional[Callable[[nn.Module], None]] = None,
                 released_after_backward: bool = True):
        """``released_after_backward``: nothing is left gathered after each backward, only after
        each step otherwise (a model that no checkpoint runs in: stock's path)."""
        import deepspeed

        self.device = device()
        self.dtype = dtype
        self.tolerance = Tolerance(dtype)
        self.gas = config["gradient_accumulation_steps"]
        self.reference = build().to(self.device)
        self.reference_optimizer = torch.optim.AdamW(_trainable(self.reference), lr=LR)
        if zero_init:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = build()
            copy_into_partitioned(model, self.reference)
        else:
            model = build()
        optimizer = torch.optim.AdamW(_trainable(model), lr=LR)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        if after_initialize is not None:
            after_initialize(self.engine.module)
        self.micro = 0
        self.released_after_backward = released_after_backward

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def forward_backward(self, inputs, target, label: str, skip_reference: bool = False) -> torch.Tensor:
        """One micro-batch on this rank's rows; the reference accumulates over all ranks' rows."""
        local_inputs = _to(local_rows(inputs), self.device, self.dtype)
        local_target = _to(local_rows(target), self.device, self.dtype)
        loss = self.engine(local_inputs, local_target)
        self.engine.backward(loss)
        if self.released_after_backward:
            assert_all_released(self.module, f"after backward of {label}")
        if not skip_reference:
            with torch.no_grad():
                expected = self.reference(_to(local_rows(inputs), self.device, torch.float32),
                                          local_rows(target).to(self.device))
            self.tolerance.check(loss.detach(), expected, f"{label} loss")
            reference_loss = self.reference(_to(inputs, self.device, torch.float32), target.to(self.device))
            (reference_loss / self.gas).backward()
        return loss

    def check_grads(self, label: str) -> None:
        from deepspeed.utils import safe_get_full_grad

        scale = _loss_scale(self.engine)
        for (name, param), reference in zip(self.module.named_parameters(), self.reference.parameters()):
            if not param.requires_grad:
                continue
            grad = safe_get_full_grad(param)
            if reference.grad is None:
                if grad is not None and grad.abs().max() > 0:
                    raise Mismatch(f"{label}: {name} has a gradient, the reference has none")
                continue
            if grad is None:
                raise Mismatch(f"{label}: {name} has no gradient, the reference has one")
            self.tolerance.check(grad.float() / scale, reference.grad, f"{label} grad of {name}")

    def step(self, label: str, reference_too: bool = True) -> None:
        self.engine.step()
        if reference_too:
            self.reference_optimizer.step()
        self.reference_optimizer.zero_grad()
        assert_all_released(self.module, f"after step of {label}")

    def train(self, steps: int, batch: Callable[[int, int], tuple], first_step: int = 0) -> List[float]:
        losses = []
        for step in range(first_step, first_step + steps):
            for micro in range(self.gas):
                inputs, target = batch(step, micro)
                losses.append(self.forward_backward(inputs, target, f"step {step} micro-batch {micro}").item())
                if micro < self.gas - 1:
                    self.engine.step()  # deepspeed counts micro-batches in step(); no update yet
            self.check_grads(f"step {step}")
            self.step(f"step {step}")
        return losses


def _trainable(model: nn.Module):
    return [param for param in model.parameters() if param.requires_grad]


def _loss_scale(engine) -> float:
    """safe_get_full_grad returns fp16 grads still multiplied by the loss scale."""
    if not engine.fp16_enabled():
        return 1.0
    return float(engine.optimizer.loss_scale)


def copy_into_partitioned(model: nn.Module, source: nn.Module) -> None:
    """Give a model built under zero.Init the reference's values, on every rank, in one
    GatheredParameters over them all (deepspeed's list gather)."""
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for param, value in zip(params, source.parameters()):
            param.copy_(value.to(param.device, param.dtype))


def gathered_count(module: nn.Module) -> int:
    from tests.unit.zero_state import gathered_or_active

    return len(gathered_or_active(module))


def random_rows(dim: int, ranks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of MICRO_BATCH rows per rank for ``ranks`` ranks, seeded: every rank's
    rows, as plain torch's reference takes them; local_rows takes one rank's."""
    generator = torch.Generator().manual_seed(1)
    rows = MICRO_BATCH * ranks
    return torch.randn(rows, dim, generator=generator), torch.randn(rows, dim, generator=generator)


def sgd_engine(model: nn.Module, lr: float, overrides: Optional[dict] = None):
    """deepspeed.initialize with plain SGD over ``model``'s trainable params (base_config, merged
    with ``overrides``): the engine of the small custom-model tests against plain_torch.sgd_reference."""
    import deepspeed

    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=lr)
    config = merge(base_config(), dict({"zero_allow_untested_optimizer": True}, **(overrides or {})))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_mean_losses(engine, x: torch.Tensor, target: torch.Tensor, steps: int) -> List[float]:
    """``steps`` training steps on this rank's rows; nothing gathered after each; each step's loss
    averaged over the ranks in fp32 (plain torch's over every rank's rows, with as many rows per
    rank)."""
    import deepspeed.comm as dist

    losses = []
    for step in range(steps):
        loss = engine(x, target)
        engine.backward(loss)
        engine.step()
        assert_all_released(engine.module, f"after step {step}")
        mean = loss.detach().float().clone()
        del loss
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def gathered_trainable(module: nn.Module) -> dict:
    """Every trainable param's full value, by name."""
    import deepspeed

    values = {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            with deepspeed.zero.GatheredParameters([param]):
                values[name] = param.detach().cpu().clone()
    return values


def assert_trained_as(expected: Tuple[List[float], Dict[str, torch.Tensor]], losses: List[float],
                      values: Dict[str, torch.Tensor], label: str = "") -> None:
    """Losses (rtol 1e-5) and trained values (rtol 1e-4) against plain torch's ``expected``
    (plain_torch.sgd_reference's (losses, values))."""
    expected_losses, expected_values = expected
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{label}losses {losses} vs plain torch {expected_losses}: {m}")
    assert values.keys() == expected_values.keys(), f"{label}{sorted(values)} vs {sorted(expected_values)}"
    for name, expected_value in expected_values.items():
        torch.testing.assert_close(values[name], expected_value, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{label}{name} vs plain torch: {m}")
