"""What the tests, the benchmark and the examples share, and what users may reuse in tests of
their own. Nothing here is imported by the patch or the start-up hook.

    ranks          one machine's ranks: port, backend, each rank's environment and process group
    probes         all-gathers and gathered bytes on a ZeRO-3 model (docs/measuring.md)
    workloads      LLM-shaped LoRA blocks, or HF Llama + PEFT LoRA, under checkpointing
    frozen_blocks  the seed's reproducer as a model: frozen LayerNorm + trainable Linear blocks
    llama_lora     the small LoRA Llama, its data and ZeRO-3 configs, the HF Trainer's
    cpu_ranks      lets accelerate (under the Trainer and TRL) see deepspeed's CPU ranks
    training       the examples' training loop and their account of the fix
    teardown       frees the engines a process is done with (between tests, between bench depths)
"""
