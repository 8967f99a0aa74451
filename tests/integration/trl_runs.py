"""TRL trainer runs (SFTTrainer, DPOTrainer, GRPOTrainer) on a PEFT LoRA Llama under ZeRO-3, in
the modes their tests compare, and the checks every such run shares.

TRL 0.28 and later force ``use_reentrant=True`` for PEFT + ZeRO-3 + checkpointing, to dodge the
crash the package fixes, by writing the deprecated ``args.gradient_checkpointing_kwargs``. The
modes:
  - ``stock``: the reference, the patch reverted, ``use_reentrant=True`` passed (TRL's workaround
    itself, which stock trains on every deepspeed of the matrix);
  - ``shipped``: the checkpointing kwargs left unset, as users write ``gradient_checkpointing=True``,
    with the package. Which flavour then trains is TRL's and transformers' doing, step by step
    (AS_SHIPPED): transformers >= 5.24 reads only ``activation_checkpointing_kwargs`` in train(), so
    TRL's force never reaches the first enable, and DPO and GRPO re-enable checkpointing mid-run
    with TRL's dict;
  - ``shipped_on_stock``: the same with the patch reverted: stock's outcome as users meet it;
  - ``undone``: ``use_reentrant=False`` passed and TRL's force undone in the trainer's arguments
    after it is built (hf_runs' undo_reentrant_force), with the package: non-reentrant throughout;
  - ``forced``: ``use_reentrant=True`` passed, with the package: the reference where stock cannot
    train at all (reference_run).
"""
from typing import Callable, Dict, Optional, Tuple

from tests.integration.hf_runs import (ReleasedAfterEveryStep, checkpoint_modes, logged_losses, reset_accelerate,
                                       trainable_values, trl_forces_reentrant, undo_reentrant_force)
from tests.unit.patch_switch import is_mixed_dtype_gather_crash, is_recompute_crash, patch_reverted, stock_crashes

MODES = ("stock", "shipped", "shipped_on_stock", "undone", "forced")
ON_STOCK = ("stock", "shipped_on_stock")
# Stock's outcomes: it trains, it dies of the recompute crash, or of deepspeed #8072's mixed-dtype
# gather (0.19.2 with bf16 frozen params and PEFT's fp32 adapters under zero.Init, in any flavour).
TRAINS, CRASH, GATHER_CRASH = "trains", "crash", "gather crash (#8072)"
# The use_reentrant each step trains with when users leave the kwargs unset, by (trainer, the
# transformers major version) on the pinned stacks (requirements/hf.txt, hf4.txt): (the first
# step's, every later step's). Read from TRL 1.16 and transformers 5.24 / TRL 0.24 and 4.57:
# - 5.x: train() enables checkpointing from activation_checkpointing_kwargs, which TRL never
#   writes: non-reentrant (5.24's default). DPO re-enables it with TRL's dict around each step's
#   reference pass (from step 2 on), GRPO around generation, which precedes its first forward.
# - 4.57: gradient_checkpointing_enable() defaults to reentrant, and TRL 0.24 forces nothing.
AS_SHIPPED: Dict[Tuple[str, int], Tuple[bool, bool]] = {
    ("sft", 5): (False, False), ("dpo", 5): (False, True), ("grpo", 5): (True, True),
    ("sft", 4): (True, True), ("dpo", 4): (True, True), ("grpo", 4): (True, True),
}


def require_trl():
    import pytest

    from tests.integration.hf_runs import require_hf_stack

    require_hf_stack()
    return pytest.importorskip("trl", reason="trl is not installed: pip install '.[hf]' (requirements/hf.txt)")


def compared_modes():
    """The modes a test compares against ``stock``."""
    return ("shipped", "undone")


def expected_flavours(trainer: str, steps: int) -> Tuple[bool, ...]:
    """AS_SHIPPED's use_reentrant per step for ``trainer`` on the installed transformers."""
    import transformers
    from packaging.version import Version

    first, later = AS_SHIPPED[trainer, Version(transformers.__version__).major]
    return (first, ) + (later, ) * (steps - 1)


def trl_run(build_trainer: Callable, mode: str, on_stock: bool = False, faulted_step: Optional[int] = None) -> Dict:
    """``build_trainer(use_reentrant, callbacks)`` (a TRL trainer asked for that checkpoint mode,
    None: the kwargs left unset) trained in ``mode`` (on stock, the patch reverted, where ``mode``
    is "stock" or "shipped_on_stock", or ``on_stock``: the canaries' undone run); returns its
    logged history and losses, the trainable values before and after training, the checkpoint
    modes that trained (at the end, and per step), the steps checked for leftovers, whether the
    model was under ZeRO-3, and the outcome: TRAINS, or on stock CRASH or GATHER_CRASH (anything
    else raises). ``faulted_step`` (global_step, from 1): a step whose backward raised, checked for
    leftovers only at the end of the next."""
    from transformers import set_seed

    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    reset_accelerate()
    released = ReleasedAfterEveryStep(() if faulted_step is None else (faulted_step, ))
    initial, flavours = InitialValues(), CheckpointFlavours()
    # The same random state for the adapters' init too: a trainer given a path and a peft_config
    # (TRL's SFTTrainer) wraps the model before its Trainer seeds anything.
    set_seed(0)
    requested = {"stock": True, "shipped": None, "shipped_on_stock": None, "undone": False, "forced": True}[mode]
    trainer = build_trainer(requested, [released, initial, flavours])
    if mode == "undone" and trl_forces_reentrant():
        undo_reentrant_force(trainer)
    # Every run draws from the same random state (a trainer that generates samples from the global one).
    set_seed(0)
    outcome = TRAINS
    try:
        if mode in ON_STOCK or on_stock:
            with patch_reverted():
                trainer.train()
        else:
            trainer.train()
    except Exception as error:  # noqa: BLE001 - only stock's known crashes are outcomes
        if mode not in ON_STOCK or not (is_recompute_crash(error) or is_mixed_dtype_gather_crash(error)):
            raise
        outcome = CRASH if is_recompute_crash(error) else GATHER_CRASH
    finally:
        flavours.close()
    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    return {"history": trainer.state.log_history, "losses": logged_losses(trainer), "initial": initial.values,
            "values": trainable_values(model), "modes": checkpoint_modes(model), "steps": released.steps,
            "flavours": flavours.per_step(), "zero3": _has_zero3_params(model), "outcome": outcome}


def reference_run(build_trainer: Callable) -> Dict:
    """TRL's workaround (``use_reentrant=True`` passed) on stock; where stock dies of #8072's gather
    in it, the same with the package (its "reference" says which)."""
    run = trl_run(build_trainer, "stock")
    if run["outcome"] == GATHER_CRASH:
        run = dict(trl_run(build_trainer, "forced"), reference="the package, reentrant: stock fails #8072's gather")
    return dict({"reference": "stock, reentrant"}, **run)


def expected_stock_outcome(flavours: Tuple[Optional[bool], ...], reference: Dict) -> str:
    """Stock's outcome for a run whose steps trained with ``flavours``: #8072's gather where stock's
    own reference run died of it, else the recompute crash in the first step that ran
    non-reentrant, where stock has it (patch_switch.stock_crashes)."""
    if reference["reference"] != "stock, reentrant":
        return GATHER_CRASH
    return CRASH if stock_crashes() and False in flavours else TRAINS


class CheckpointFlavours:
    """A TrainerCallback (duck-typed) that notes, at each training forward of the model (grad
    enabled, outside backward), the use_reentrant every checkpointed transformers layer is set to
    then (its checkpoint function's keyword; unset, torch's default, reentrant), by step: the
    flavour that really runs, whatever enabled it. Noted at the root, outside any checkpoint:
    transformers 4.x checkpoints a layer's __call__, where a reentrant forward runs without grad."""

    def __init__(self):
        self._step = 0
        self._seen: Dict[int, set] = {}
        self._handle = None

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._handle = model.register_forward_pre_hook(self._note)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step

    def _note(self, model, args) -> None:
        import torch
        from transformers.modeling_layers import GradientCheckpointingLayer

        if not (model.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1):
            return
        for module in model.modules():
            if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
                keywords = getattr(module._gradient_checkpointing_func, "keywords", {})
                self._seen.setdefault(self._step, set()).add(keywords.get("use_reentrant", True))

    def per_step(self) -> Tuple[Optional[bool], ...]:
        """Each step's use_reentrant; None for a step with no checkpointed forward."""
        steps = range(max(self._seen) + 1) if self._seen else ()
        flavours = []
        for step in steps:
            seen = self._seen.get(step, set())
            if len(seen) > 1:
                raise AssertionError(f"step {step} trained with both flavours: {seen}")
            flavours.append(next(iter(seen)) if seen else None)
        return tuple(flavours)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
        self._handle = None


def runs_as_shipped(trainer: str, build_trainer: Callable, modes: Tuple[str, ...], steps: int) -> Dict[str, Dict]:
    """The reference (reference_run), then each of ``modes``; printed with the TRL table's row, and
    each step's flavour and stock's outcome checked (assert_as_shipped)."""
    runs = {"stock": reference_run(build_trainer)}
    runs.update((mode, trl_run(build_trainer, mode)) for mode in modes)
    print("\n".join(f"{mode}: losses {run['losses']}, use_reentrant per step {run['flavours']}, {run['outcome']}"
                    for mode, run in runs.items()))
    print(as_shipped_row(trainer, runs))
    assert_as_shipped(trainer, runs, steps)
    return runs


def as_shipped_row(trainer: str, runs: Dict[str, Dict]) -> str:
    """One row of the TRL table (README, docs/testing.md): trainer, transformers, deepspeed, the
    flavour per step, stock's outcome, the package's."""
    import deepspeed
    import transformers

    names = {True: "reentrant", False: "non-reentrant", None: "none"}
    flavours = " / ".join(names[flavour] for flavour in runs["shipped"]["flavours"])
    return (f"TRL table: {trainer} | transformers {transformers.__version__} | deepspeed {deepspeed.__version__} | "
            f"{flavours} | stock {runs['shipped_on_stock']['outcome']} | package trains, as the reference "
            f"({runs['stock']['reference']})")


def assert_as_shipped(trainer: str, runs: Dict[str, Dict], steps: int) -> None:
    """The shipped runs took the flavours AS_SHIPPED names, step by step, and stock met the outcome
    those flavours give it (a stock run that trained is compared by assert_trains_as_stock)."""
    expected = expected_flavours(trainer, steps)
    for mode in ("shipped", "shipped_on_stock"):
        if mode not in runs:
            continue
        got = runs[mode]["flavours"]
        if runs[mode]["outcome"] != TRAINS:
            assert got == expected[:len(got)], f"{mode}: flavours per step {got}, expected {expected}"
        else:
            assert got == expected, f"{mode}: use_reentrant per step {got}, expected {expected} (AS_SHIPPED)"
    if "shipped_on_stock" in runs:
        outcome = runs["shipped_on_stock"]["outcome"]
        wanted = expected_stock_outcome(expected, runs["stock"])
        assert outcome == wanted, f"stock as shipped: {outcome}, expected {wanted} for flavours {expected}"


class InitialValues:
    """A TrainerCallback (duck-typed) that keeps every trainable param's full value when training
    begins, after the trainer has wrapped the model and put it under ZeRO-3."""

    def __init__(self):
        self.values: Dict = {}

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.values = trainable_values(model)


def assert_trains_as_stock(runs: Dict[str, Dict], steps: int, loss_tolerance: float, value_tolerance: float) -> None:
    """Each compared run trained under ZeRO-3 in its checkpoint mode, left nothing gathered after
    any of its ``steps`` steps, logged ``steps`` losses equal to stock's, and moved every trainable
    param as stock did (each move against ``value_tolerance``; stock must move some param by
    more than 100 times it, or the comparison would say nothing)."""
    import torch

    reference = runs["stock"]
    assert reference["modes"] == {True}, f"the stock reference trained with use_reentrant {reference['modes']}"
    moves = {name: value - reference["initial"][name] for name, value in reference["values"].items()}
    largest = max(float(move.abs().max()) for move in moves.values())
    assert largest > 100 * value_tolerance, f"stock moved no trainable param by more than {largest}"
    for mode, run in runs.items():
        if run["outcome"] != TRAINS:
            continue  # stock as shipped, crashed: assert_as_shipped's
        assert run["zero3"], f"{mode}: the trainer did not put the model under ZeRO-3"
        assert run["steps"] == steps, f"{mode}: checked after {run['steps']} steps of {steps}"
        assert len(run["losses"]) == steps, f"{mode}: expected {steps} logged losses, got {run['losses']}"
        if mode == "stock":
            continue
        if mode == "undone":
            assert run["modes"] == {False}, f"{mode}: trained with use_reentrant {run['modes']}, expected False"
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=0,
                                   atol=loss_tolerance,
                                   msg=lambda m: f"{mode}: losses {run['losses']} vs stock {reference['losses']}: {m}")
        assert run["values"].keys() == moves.keys(), f"{mode}: trainable params {sorted(run['values'])}"
        for name, move in moves.items():
            torch.testing.assert_close(run["values"][name] - run["initial"][name], move, rtol=1e-3,
                                       atol=value_tolerance,
                                       msg=lambda m: f"{mode}: how far {name} moved vs stock: {m}")


def _has_zero3_params(model) -> bool:
    from tests.unit.zero_state import zero3_params

    return bool(zero3_params(model))
