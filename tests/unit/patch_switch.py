"""Run a block on stock deepspeed, then put the patch back as it was found."""
import contextlib
import re

import zero3_recompute


@contextlib.contextmanager
def patch_reverted():
    """Stock deepspeed inside the block; afterwards, patched again only if it was before, with the
    policy it had.

    So a run with ZERO3_RECOMPUTE_DISABLE set stays unpatched. The block may apply() itself.
    """
    before = zero3_recompute.status()
    zero3_recompute.revert()
    try:
        yield
    finally:
        zero3_recompute.revert()
        if before.active:
            zero3_recompute.apply(policy=before.policy)


@contextlib.contextmanager
def policy_in_force(name: str):
    """The package patched with release policy ``name`` inside the block; afterwards, the patch
    state and policy it found. Under the opt-out (ZERO3_RECOMPUTE_DISABLE) the block runs on
    deepspeed as it is, so the suite still sees stock's behaviour there."""
    from zero3_recompute.autoload import disabled

    if disabled():
        yield
        return
    before = zero3_recompute.status()
    zero3_recompute.apply(policy=name)
    try:
        yield
    finally:
        if before.active:
            zero3_recompute.apply(policy=before.policy)
        else:
            zero3_recompute.revert()


@contextlib.contextmanager
def layers_switched_off(*layers: str, policy: str = "auto"):
    """The package patched with ``policy`` and ``layers`` switched off (ZERO3_RECOMPUTE_LAYERS_OFF)
    inside the block; afterwards, patched again as it was found, every layer on."""
    import os

    from zero3_recompute.patch import ENV_LAYERS_OFF

    before = zero3_recompute.status()
    zero3_recompute.revert()
    os.environ[ENV_LAYERS_OFF] = ",".join(layers)
    try:
        zero3_recompute.apply(policy=policy)
        yield
    finally:
        os.environ.pop(ENV_LAYERS_OFF, None)
        zero3_recompute.revert()
        if before.active:
            zero3_recompute.apply(policy=before.policy)


def upstream_installed() -> bool:
    """deepspeed's own recompute handling (0.19.3 on) is in the installed code: there,
    patch_reverted() runs deepspeed's own handling, which trains the seed bug's model."""
    from zero3_recompute.targets import upstream_handling

    return upstream_handling() is not None


def stock_crashes() -> bool:
    """Stock deepspeed raises the seed bug's CheckpointError here: no handling of its own, and a
    torch whose checkpoint stores a frozen tensor itself (2.5 on). On torch 2.4 stock trains the
    seed model, leaking where a block's backward release never fires (scenarios.py records it)."""
    from zero3_recompute.torch_recompute import recompute_keeps_frozen_tensors

    return not upstream_installed() and recompute_keeps_frozen_tensors()


# The seed bug's own failure, as each checkpoint shows it: torch's metadata check sees a frozen
# param shrunk to stock's partitioned tensor (0 elements, 1 on the fast leaf path); where the
# check is not made (deepspeed's non_reentrant_checkpoint, torch 2.4, deepspeed's own handling
# with early stop off), an op is handed that 0-element param.
_CHECK_SAW_PARTITIONED = re.compile(r"recomputed metadata: \{'shape': torch\.Size\(\[[01]\]\)")
_OP_GIVEN_PARTITIONED = re.compile(r"size of tensor [ab] \(0\)|\b0x\d+\b|\b\d+x0\b")


def is_recompute_crash(error: BaseException) -> bool:
    """Whether ``error`` is the crash the package fixes, not some other failure in backward."""
    import torch.utils.checkpoint

    if isinstance(error, torch.utils.checkpoint.CheckpointError):
        return bool(_CHECK_SAW_PARTITIONED.search(str(error)))
    return isinstance(error, RuntimeError) and bool(_OP_GIVEN_PARTITIONED.search(str(error)))


# deepspeed 0.19.2's list gather of params of several dtypes (NOTE [ Mixed-dtype gathers ]): the
# output buffer has the first param's dtype, the input another; gloo and NCCL word it so.
_MIXED_DTYPE_GATHER = ("invalid tensor type", "output tensor must have the same type as input tensor")


def is_mixed_dtype_gather_crash(error: BaseException) -> bool:
    """Whether ``error`` is deepspeed #8072's crash, which the mixed-dtype gather layer fixes."""
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _MIXED_DTYPE_GATHER)


def mixed_dtype_gather_needed() -> bool:
    """Whether this deepspeed sizes a list gather by its first param's dtype while its engine leaves a
    ZeRO-Init model's dtypes mixed (targets.mixed_dtype_gather, read from its code)."""
    from zero3_recompute.targets import mixed_dtype_gather

    return mixed_dtype_gather().needed


def why_stock_trains() -> str:
    import torch

    if upstream_installed():
        return "deepspeed's own handling trains this when the package is reverted"
    return (f"torch {torch.__version__}'s checkpoint stores a detached alias of every tensor: stock trains this "
            "(test_stock_behaviour checks the leaks it leaves)")


def assert_stock_crashes(run) -> None:
    """The canary of a regression test: skipped where stock trains (why_stock_trains); else
    ``run()``, which runs the test's model on stock, must raise the crash the package fixes."""
    import pytest

    if not stock_crashes():
        pytest.skip(f"{why_stock_trains()}: {zero3_recompute.status()}")
    with pytest.raises(Exception) as raised:
        run()
    assert is_recompute_crash(raised.value), f"stock failed otherwise than by the recompute crash: {raised.value!r}"
