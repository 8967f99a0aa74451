"""The examples' training loop and its one-line account of the fix."""
import time

import torch.nn as nn

from zero3_recompute.testing.probes import available_bytes, zero3_params


def gathered_bytes(module: nn.Module) -> int:
    """Bytes of this rank's non-persistent ZeRO-3 params gathered now."""
    return available_bytes([param for param in zero3_params(module) if not param.ds_persist])


def train_steps(engine, steps: int, compute_loss, rank: int):
    """forward/backward/step ``steps`` times; rank 0 prints each step. Returns the losses."""
    losses = []
    for step in range(steps):
        started = time.perf_counter()
        loss = compute_loss(step)
        engine.backward(loss)
        after_backward = gathered_bytes(engine.module)
        engine.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}  gathered after backward {after_backward} B  "
                  f"{time.perf_counter() - started:.2f} s", flush=True)
    return losses


def describe_fix() -> str:
    try:
        import zero3_recompute
    except ImportError:
        return "zero3_recompute not installed"
    return str(zero3_recompute.status())
