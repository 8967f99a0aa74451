"""Whether the installed torch is one the bug can hit: does its non-reentrant checkpoint keep a
frozen tensor that the recompute saved as that very object?

torch 2.5 on stores ``x`` itself when ``x`` needs no grad (a detached alias otherwise), so a
ZeRO-3 release during the recompute shrinks what the checkpoint stored and its metadata check
raises CheckpointError. torch 2.4 stored ``x.detach()`` for every tensor: the alias keeps the
gathered storage, and stock trains (with params of modules whose backward never fires left
gathered). Found by running torch, not by its version number: a checkpointed product whose
frozen factor shrinks right after the recompute used it, as ZeRO-3's release would.
"""
import functools
import warnings


@functools.lru_cache(maxsize=None)
def recompute_keeps_frozen_tensors() -> bool:
    """True where shrinking a frozen tensor inside the recompute fails torch's checkpoint."""
    import torch
    import torch.utils.checkpoint

    frozen = torch.ones(2)
    x = torch.ones(2, requires_grad=True)

    def product(inputs):
        out = inputs * frozen
        if torch._C._current_graph_task_id() != -1:
            frozen.data = torch.empty(0)  # what ZeRO-3's release does to a Parameter
        # Saves one more tensor, so that a recompute that stops early stops only after the shrink.
        return out.exp()

    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.4's checkpoint warns of its own deprecated autocast call
        loss = torch.utils.checkpoint.checkpoint(product, x, use_reentrant=False).sum()
        try:
            loss.backward()
        except torch.utils.checkpoint.CheckpointError:
            return True
    return False
