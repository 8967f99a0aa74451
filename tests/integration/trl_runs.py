"""TRL trainer runs (DPOTrainer and the like) on a PEFT LoRA Llama under ZeRO-3, in the three
modes their tests compare, and the checks every such run shares.

TRL 0.28 and later force ``use_reentrant=True`` for PEFT + ZeRO-3 + checkpointing, to dodge the
crash the package fixes. The modes, all asking for non-reentrant checkpointing as users' scripts
do (TRL's own default) unless said otherwise:
  - ``stock``: the reference, the patch reverted, reentrant checkpointing (what stock trains on
    every deepspeed of the matrix: TRL's workaround itself);
  - ``shipped``: as TRL ships it, with the package (forced reentrant where TRL forces it);
  - ``undone``: the force undone in the trainer's arguments after it is built (hf_runs'
    undo_reentrant_force), with the package: the path the crash was on.
TRL before 0.28 forces nothing: there ``shipped`` is ``undone``, and the tests run the latter.
"""
from typing import Callable, Dict

from tests.integration.hf_runs import (ReleasedAfterEveryStep, checkpoint_modes, logged_losses, reset_accelerate,
                                       trainable_values, trl_forces_reentrant, undo_reentrant_force)
from tests.unit.patch_switch import patch_reverted

MODES = ("stock", "shipped", "undone")


def require_trl():
    import pytest

    from tests.integration.hf_runs import require_hf_stack

    require_hf_stack()
    return pytest.importorskip("trl", reason="trl is not installed: pip install '.[hf]' (requirements/hf.txt)")


def compared_modes():
    """The modes a test compares against ``stock``: ``shipped`` only where TRL forces reentrant."""
    return ("shipped", "undone") if trl_forces_reentrant() else ("undone",)


def expected_reentrant(mode: str) -> bool:
    return {"stock": True, "shipped": trl_forces_reentrant(), "undone": False}[mode]


def trl_run(build_trainer: Callable, mode: str, on_stock: bool = False) -> Dict:
    """``build_trainer(use_reentrant, callbacks)`` (a TRL trainer asked for that checkpoint mode)
    trained in ``mode`` (on stock, the patch reverted, where ``mode`` is "stock" or ``on_stock``,
    the canaries' undone run); returns its logged history and losses, the trainable values before and
    after training, the checkpoint modes that trained, the steps checked for leftovers, and
    whether the model was under ZeRO-3."""
    from transformers import set_seed

    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    reset_accelerate()
    released, initial = ReleasedAfterEveryStep(), InitialValues()
    trainer = build_trainer(mode == "stock", [released, initial])
    if mode == "undone" and trl_forces_reentrant():
        undo_reentrant_force(trainer)
    # Every run draws from the same random state (a trainer that generates samples from the global one).
    set_seed(0)
    if mode == "stock" or on_stock:
        with patch_reverted():
            trainer.train()
    else:
        trainer.train()
    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    return {"history": trainer.state.log_history, "losses": logged_losses(trainer), "initial": initial.values,
            "values": trainable_values(model), "modes": checkpoint_modes(model), "steps": released.steps,
            "zero3": _has_zero3_params(model)}


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
        assert run["zero3"], f"{mode}: the trainer did not put the model under ZeRO-3"
        assert run["steps"] == steps, f"{mode}: checked after {run['steps']} steps of {steps}"
        assert len(run["losses"]) == steps, f"{mode}: expected {steps} logged losses, got {run['losses']}"
        if mode == "stock":
            continue
        assert run["modes"] == {expected_reentrant(mode)}, \
            f"{mode}: trained with use_reentrant {run['modes']}, expected {expected_reentrant(mode)}"
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
