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
import contextlib
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


def trl_run(build_trainer: Callable, mode: str) -> Dict:
    """``build_trainer(use_reentrant, callbacks)`` (a TRL trainer asked for that checkpoint mode)
    trained in ``mode``; returns its logged history, losses, trainable values at the end, the
    checkpoint modes that trained and the steps checked for leftovers."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    from transformers import set_seed

    reset_accelerate()
    released = ReleasedAfterEveryStep()
    trainer = build_trainer(mode == "stock", [released])
    if mode == "undone" and trl_forces_reentrant():
        undo_reentrant_force(trainer)
    # Every run draws from the same random state (a trainer that generates samples from the global one).
    set_seed(0)
    if mode == "stock":
        with patch_reverted():
            trainer.train()
    else:
        trainer.train()
    model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    return {"history": trainer.state.log_history, "losses": logged_losses(trainer),
            "values": trainable_values(model), "modes": checkpoint_modes(model), "steps": released.steps,
            "zero3": _has_zero3_params(model)}


def assert_trains_as_stock(runs: Dict[str, Dict], steps: int, loss_tolerance: float, value_tolerance: float) -> None:
    """Each compared run trained under ZeRO-3 in its checkpoint mode, left nothing gathered after
    any of its ``steps`` steps, logged ``steps`` losses equal to stock's, and moved every trainable
    param as stock did."""
    import torch

    reference = runs["stock"]
    assert reference["modes"] == {True}, f"the stock reference trained with use_reentrant {reference['modes']}"
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
        assert run["values"].keys() == reference["values"].keys()
        for name, value in reference["values"].items():
            torch.testing.assert_close(run["values"][name], value, rtol=1e-4, atol=value_tolerance,
                                       msg=lambda m: f"{mode}: {name} after training vs stock: {m}")


@contextlib.contextmanager
def every_gloo_gather_waited():
    """GatheredParameters over many params (TRL gathers the whole policy to generate) with each
    param's all-gather waited on. deepspeed 0.14.5 to 0.19.3 launch one asynchronous all-gather
    per param in Init._allgather_params_coalesced and wait on the last handle only: right
    under NCCL, whose collectives run in order on one stream, but gloo runs them on several
    threads, so on the CPU a param can be read before its gather lands (in our GRPO runs on
    0.19.2, the final norm's weight, second to last, held uninitialized memory on one rank in
    about 1 generation in 12; none once every handle is waited on). deepspeed 0.19.8 waits on
    every handle. Gathering one param per call makes its handle the last."""
    from deepspeed.runtime.zero.partition_parameters import Init

    coalesced = Init.__dict__["_allgather_params_coalesced"]

    def one_param_per_call(self, param_list, hierarchy=0, quantize=False):
        for param in param_list:
            coalesced(self, [param], hierarchy, quantize)

    Init._allgather_params_coalesced = one_param_per_call
    try:
        yield
    finally:
        Init._allgather_params_coalesced = coalesced


def _has_zero3_params(model) -> bool:
    from tests.unit.zero_state import zero3_params

    return bool(zero3_params(model))
