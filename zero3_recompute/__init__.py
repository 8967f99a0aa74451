"""zero3_recompute: ZeRO-3 + activation checkpointing + frozen params, without CheckpointError.

Importing this package is cheap and imports neither torch nor deepspeed: the start-up hook
(zero3_recompute.pth, see zero3_recompute.autoload) imports it in every Python process.

Public API:
    apply()  - patch the installed deepspeed (idempotent); raises a named error where it can't;
               apply(policy="keep" | "release" | "auto") picks the release policy
    revert() - restore deepspeed's original methods
    status() - report where the patch stands, as a PatchStatus
"""

__version__ = "0.1.0"
__all__ = ["apply", "revert", "status", "__version__"]


def apply(policy=None):
    """Patch the installed deepspeed. See zero3_recompute.patch.apply and zero3_recompute.policies."""
    from zero3_recompute import patch

    return patch.apply(auto=False, policy=policy)


def revert():
    """Restore deepspeed's original methods. See zero3_recompute.patch.revert."""
    from zero3_recompute import patch

    return patch.revert()


def status():
    """Report where the patch stands. See zero3_recompute.patch.status."""
    from zero3_recompute import patch

    return patch.status()
