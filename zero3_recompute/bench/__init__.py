"""``zero3-recompute bench``: stock deepspeed, deepspeed's own handling and each release policy
side by side on one model, in one invocation, in ranks of its own.

    options     what to run (the command line's flags)
    configs     the configurations: no checkpointing, stock / upstream, TRL's path, each policy
    worker      one rank: every configuration's engine, steps interleaved, measured
    launch      spawns the ranks, shows progress, collects their results
    report      the table, bench.json and bench.png

The models, the probes (all-gathers and gathered bytes, as docs/measuring.md defines them) and
the rank set-up are the test harness's too: zero3_recompute.testing.

Nothing here is imported by the patch or the start-up hook.
"""
