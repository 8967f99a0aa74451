"""Command line: ``python -m zero3_recompute doctor | bench`` (also the ``zero3-recompute`` console script)."""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zero3-recompute",
                                     description="ZeRO-3 + activation checkpointing + frozen params, fixed.")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="am I affected, and is the fix active? (exit 1: affected, fix off)")
    doctor.add_argument("--no-reproduce", action="store_true",
                        help="judge by version only; skip the 1-rank CPU reproduction in a subprocess")
    bench = commands.add_parser("bench", help="stock, deepspeed's own handling and each policy side by side: "
                                              "all-gathers, gathered memory, step time")
    from zero3_recompute.bench.cli import configure

    configure(bench)
    args = parser.parse_args(argv)
    if args.command == "bench":
        from zero3_recompute.bench.cli import run as run_bench

        return run_bench(args)
    from zero3_recompute.doctor import run

    return run(reproduce=not args.no_reproduce)


if __name__ == "__main__":
    sys.exit(main())
