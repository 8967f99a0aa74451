"""The seed's reproducer as a training run: ZeRO-3 + non-reentrant activation checkpointing
over blocks of a frozen LayerNorm followed by a trainable Linear.

On deepspeed 0.14.5-0.19.2 without zero3_recompute, the first backward raises
    CheckpointError: ... Recomputed values ... saved {'shape': [N]} vs recomputed {'shape': [0]}
With the package installed it trains; nothing below activates it: its .pth does.

    deepspeed --num_gpus 2 examples/train_frozen_checkpoint.py            # GPUs, or 2 CPU ranks
    deepspeed --num_gpus 2 examples/train_frozen_checkpoint.py --reentrant
"""
import argparse
import time

import deepspeed
import torch
import torch.nn as nn
import torch.utils.checkpoint
from deepspeed.accelerator import get_accelerator


class FrozenNormLinear(nn.Module):

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)
        self.norm.requires_grad_(False)

    def forward(self, x):
        return self.linear(self.norm(x))


class CheckpointedModel(nn.Module):

    def __init__(self, dim: int, blocks: int, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.blocks = nn.ModuleList(FrozenNormLinear(dim) for _ in range(blocks))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.use_reentrant)
        return nn.functional.mse_loss(x, target)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--reentrant", action="store_true", help="use_reentrant=True (TRL's PEFT + ZeRO-3 path)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def gathered_bytes(module: nn.Module) -> int:
    """Bytes of ZeRO-3 params currently gathered on this rank."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(p.ds_numel * p.element_size() for p in module.parameters()
               if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE and not p.ds_persist)


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


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = get_accelerator().current_device_name()

    torch.manual_seed(0)
    model = CheckpointedModel(args.dim, args.blocks, args.reentrant)
    teacher = torch.randn(args.dim, args.dim) / args.dim**0.5
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    # A torch optimizer: no DeepSpeed C++ optimizer op has to be compiled.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    generator = torch.Generator().manual_seed(rank)

    def compute_loss(step):
        x = torch.randn(args.micro_batch, args.dim, generator=generator)
        return engine(x.to(device).requires_grad_(), (x @ teacher).to(device))

    losses = train_steps(engine, args.steps, compute_loss, rank)
    if rank == 0:
        mode = "reentrant" if args.reentrant else "non-reentrant"
        print(f"summary: loss went from {losses[0]:.4f} to {losses[-1]:.4f} in {args.steps} steps on "
              f"{world_size} ranks ({torch.distributed.get_backend()}), ZeRO-3, {mode} checkpointing; "
              f"deepspeed {deepspeed.__version__}, torch {torch.__version__}", flush=True)
        print(f"summary: {describe_fix()}", flush=True)


if __name__ == "__main__":
    main()
