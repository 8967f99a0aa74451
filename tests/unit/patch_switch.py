"""Run a block on stock deepspeed, then put the patch back as it was found."""
import contextlib

import zero3_recompute


@contextlib.contextmanager
def patch_reverted():
    """Stock deepspeed inside the block; afterwards, patched again only if it was before.

    So a run with ZERO3_RECOMPUTE_DISABLE set stays unpatched. The block may apply() itself.
    """
    was_active = zero3_recompute.status().active
    zero3_recompute.revert()
    try:
        yield
    finally:
        zero3_recompute.revert()
        if was_active:
            zero3_recompute.apply()
