"""The benchmark's options, parsed and checked (expected vs. got) before any rank starts."""
import argparse
import math
import os
from dataclasses import asdict, dataclass
from typing import List, Optional

from zero3_recompute.errors import Zero3RecomputeError

DTYPES = ("fp32", "bf16")
MODELS = ("lora", "llama", "hooks")  # zero3_recompute.testing.workloads.BUILDERS
# "call": the checkpoint wraps a layer's __call__, its ZeRO hooks inside the recompute
# (transformers 4.x); "forward": it wraps layer.forward, the hooks outside (transformers 5).
PLACEMENTS = ("call", "forward")


class BenchUsageError(Zero3RecomputeError, ValueError):
    """An option the benchmark cannot run with."""


@dataclass(frozen=True)
class Options:
    model: str = "lora"
    blocks: tuple = (2, 4, 8)
    hidden: int = 256
    heads: int = 4
    vocab: int = 512
    seq: int = 64
    batch: int = 2
    dtype: str = "fp32"
    ranks: Optional[int] = None
    prefetch: int = 0
    reuse_distance: int = 0
    steps: int = 6
    placements: tuple = ()
    seed: int = 0
    out: str = "bench-results"
    timeout: float = 1800.0
    # stage3_max_live_parameters of the budget sweep, in one checkpointed layer's frozen numel
    # (math.inf: deepspeed's default); empty: no sweep.
    live_limits: tuple = ()

    def as_dict(self) -> dict:
        return asdict(self)


def _int_list(text: str) -> List[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,4,8, got {text!r}")
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers such as 2,4,8, got {text!r}")
    return values


def _limits(text: str) -> List[float]:
    try:
        values = [math.inf if part.strip() in ("inf", "unlimited") else float(part) for part in text.split(",")
                  if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers of layers such as 0,0.5,1,inf, got {text!r}")
    if not values or any(value < 0 or math.isnan(value) for value in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0 (or inf) such as 0,0.5,1,inf, got {text!r}")
    return values


def _placements(text: str) -> List[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [value for value in values if value not in PLACEMENTS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(PLACEMENTS)}, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Options()
    parser.add_argument("--model", choices=MODELS, default=defaults.model,
                        help="lora: LLM-shaped LoRA blocks (default); llama: HF Llama + PEFT LoRA (needs '[hf]')")
    parser.add_argument("--blocks", type=_int_list, default=list(defaults.blocks),
                        help="decoder layers, a depth sweep when several (default 2,4,8)")
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size (default 256)")
    parser.add_argument("--heads", type=int, default=defaults.heads, help="attention heads (default 4)")
    parser.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary size (default 512)")
    parser.add_argument("--seq", type=int, default=defaults.seq, help="tokens per row (default 64)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="rows per rank and step (default 2)")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype, help="fp32 (default) or bf16")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks to launch (default: one per GPU, or 2 on CPU)")
    parser.add_argument("--prefetch", type=int, default=defaults.prefetch,
                        help="stage3_prefetch_bucket_size (default 0: counts and bytes are exact)")
    parser.add_argument("--reuse-distance", type=int, default=defaults.reuse_distance,
                        help="stage3_max_reuse_distance (default 0)")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="steps per configuration: a warm-up, a measured one, the rest timed (default 6)")
    parser.add_argument("--placement", dest="placements", type=_placements, default=None,
                        help="call (hooks inside the checkpoint), forward (outside), or both "
                             "(default: call for lora, call,forward for llama)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default=defaults.out, help="folder for bench.json and bench.png (default "
                                                            "./bench-results)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout,
                        help="seconds before the ranks are stopped (default 1800)")
    parser.add_argument("--live-limits", type=_limits, default=list(defaults.live_limits),
                        help="the budget sweep: auto, non-reentrant, under each stage3_max_live_parameters given in "
                             "one checkpointed layer's frozen numel, inf for deepspeed's default (e.g. "
                             "0,0.25,0.5,1,2,inf; default: no sweep)")


def from_arguments(args: argparse.Namespace) -> Options:
    placements = args.placements or (["call", "forward"] if args.model == "llama" else ["call"])
    options = Options(model=args.model, blocks=tuple(args.blocks), hidden=args.hidden, heads=args.heads,
                      vocab=args.vocab, seq=args.seq, batch=args.batch, dtype=args.dtype, ranks=args.ranks,
                      prefetch=args.prefetch, reuse_distance=args.reuse_distance, steps=args.steps,
                      placements=tuple(placements), seed=args.seed, out=os.path.abspath(args.out),
                      timeout=args.timeout, live_limits=tuple(args.live_limits))
    check(options)
    return options


def check(options: Options) -> None:
    problems = []
    for name in ("hidden", "heads", "vocab", "batch"):
        if getattr(options, name) < 1:
            problems.append(f"--{name}: expected a positive integer, got {getattr(options, name)}")
    if options.seq < 2:
        problems.append(f"--seq: expected at least 2 tokens (the loss predicts the next one), got {options.seq}")
    if options.heads >= 1 and options.hidden % options.heads:
        problems.append(f"--hidden: expected a multiple of --heads ({options.heads}), got {options.hidden}")
    if options.steps < 3:
        problems.append(f"--steps: expected at least 3 (a warm-up, a measured, a timed), got {options.steps}")
    if options.model == "llama" and options.heads >= 1 and options.hidden % options.heads == 0 \
            and (options.hidden // options.heads) % 2:
        problems.append(f"--hidden / --heads: expected an even head size for Llama's rotary embedding, got "
                        f"{options.hidden} / {options.heads} = {options.hidden // options.heads}")
    if options.ranks is not None and options.ranks < 1:
        problems.append(f"--ranks: expected a positive integer, got {options.ranks}")
    if options.prefetch < 0 or options.reuse_distance < 0:
        problems.append(f"--prefetch / --reuse-distance: expected >= 0, got {options.prefetch} / "
                        f"{options.reuse_distance}")
    if options.timeout <= 0:
        problems.append(f"--timeout: expected seconds > 0, got {options.timeout}")
    if problems:
        raise BenchUsageError("; ".join(problems))
