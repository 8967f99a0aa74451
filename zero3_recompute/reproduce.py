"""A tiny one-rank CPU reproduction of the bug, run by ``doctor`` in a subprocess.

    python -m zero3_recompute.reproduce

Prints one JSON object: the versions, the accelerator, the patch status this environment
gives (the start-up hook, honouring ZERO3_RECOMPUTE_DISABLE), and the outcome of one ZeRO-3
training step with non-reentrant checkpointing over a frozen LayerNorm twice: once on stock
deepspeed (patch reverted) and, where the package can patch this deepspeed, once with it.
"""
import dataclasses
import json
import os
import socket
import sys
import time


def _prepare_environment() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "DS_ACCELERATOR": "cpu"}.items():
        os.environ[name] = value


def _one_step() -> dict:
    """One forward/backward/step; 'ok', or the exception's type and first line."""
    import deepspeed
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint

    class Block(nn.Module):

        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.linear = nn.Linear(8, 8)
            self.norm.requires_grad_(False)

        def forward(self, x):
            return self.linear(self.norm(x))

    class Model(nn.Module):

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x):
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            return x.square().mean()

    torch.manual_seed(0)
    model = Model()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    started = time.monotonic()
    try:
        loss = engine(torch.randn(2, 8))
        engine.backward(loss)
        engine.step()
    except Exception as exc:  # the outcome is the report
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return {"outcome": "crash", "error": f"{type(exc).__name__}: {first_line}",
                "seconds": round(time.monotonic() - started, 2)}
    return {"outcome": "ok", "seconds": round(time.monotonic() - started, 2)}


def status_report() -> dict:
    """zero3_recompute.status() as plain data, for the JSON report and doctor."""
    import zero3_recompute

    found = zero3_recompute.status()
    report = {**dataclasses.asdict(found), "switched_off": list(found.switched_off), "layers": list(found.layers),
              "active": found.active, "fixed": found.fixed}
    if found.gather_fix is None and found.deepspeed_version is not None:
        # Not patched: whether this deepspeed has the mixed-dtype gather crash all the same.
        from zero3_recompute.targets import mixed_dtype_gather

        fix = mixed_dtype_gather()
        report["gather_fix"] = f"NOT fixed, the package not patched: {fix.reason}" if fix.needed else fix.reason
    return report


def run() -> dict:
    _prepare_environment()
    import deepspeed
    import deepspeed.ops
    import torch
    from deepspeed.accelerator import get_accelerator

    import zero3_recompute

    # The CPU shared-memory allreduce op would be JIT-compiled (minutes); gloo is enough here.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    status = status_report()
    report = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "accelerator": get_accelerator().device_name(),
        "status": status,
    }
    zero3_recompute.revert()
    report["stock"] = _one_step()
    if status["mode"] in ("patched", "not-applied"):
        zero3_recompute.apply()
        report["with_package"] = _one_step()
    if status["active"]:
        zero3_recompute.apply()
    else:
        zero3_recompute.revert()
    return report


def main() -> None:
    print(json.dumps(run()), flush=True)


if __name__ == "__main__":
    main()
