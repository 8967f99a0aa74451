"""PEFT LoRA on a small Llama under ZeRO-3 with non-reentrant activation checkpointing.

The run users have: transformers' LlamaForCausalLM (built from a LlamaConfig, random init,
offline), LoRA on q_proj/v_proj, activation checkpointing with use_reentrant=False (the
transformers and TRL default), ZeRO-3, synthetic token data. On deepspeed 0.14.5-0.19.2 stock
it dies in the first backward with CheckpointError; with zero3-recompute installed it trains,
unchanged: nothing below mentions the package except the summary line.

    deepspeed --num_gpus 2 examples/train_llama_lora.py                 # 2 GPUs, or 2 CPU ranks (gloo)
    deepspeed --num_gpus 2 examples/train_llama_lora.py --reentrant     # TRL's forced PEFT path
"""
import argparse
import warnings

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from zero3_recompute.testing.llama_lora import build_lora_llama, token_batch, zero3_config
from zero3_recompute.testing.training import describe_fix, train_steps


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--reentrant", action="store_true", help="use_reentrant=True, as TRL forces for PEFT + ZeRO-3")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def main():
    args = parse_args()
    # torch.distributed's deprecation notices for the collectives deepspeed calls, once per call site and rank.
    warnings.filterwarnings("ignore", category=FutureWarning)
    deepspeed.init_distributed()
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = get_accelerator().current_device_name()

    model = build_lora_llama(use_reentrant=args.reentrant)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero3_config(args.micro_batch))

    def compute_loss(step):
        input_ids = token_batch(step, rank, args.micro_batch).to(device)
        return engine(input_ids=input_ids, labels=input_ids).loss

    losses = train_steps(engine, args.steps, compute_loss, rank)
    if rank == 0:
        import peft
        import transformers

        mode = "reentrant" if args.reentrant else "non-reentrant"
        print(f"summary: loss went from {losses[0]:.4f} to {losses[-1]:.4f} in {args.steps} steps on {world_size} "
              f"ranks ({torch.distributed.get_backend()}): LlamaForCausalLM + PEFT LoRA (q_proj, v_proj), "
              f"ZeRO-3, {mode} activation checkpointing", flush=True)
        print(f"summary: deepspeed {deepspeed.__version__}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, peft {peft.__version__}", flush=True)
        print(f"summary: {describe_fix()}", flush=True)


if __name__ == "__main__":
    main()
