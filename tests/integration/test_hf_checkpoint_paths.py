"""transformers', PEFT's and deepspeed's other ways into a checkpoint (tests/integration/checkpoint_paths.py),
2 ranks, bf16, HF's "auto" ZeRO-3 values, the package active as pip install leaves it:
transformers' every_n_layers (checkpointed and plain layers mixed) and offload=True (saved inputs
under save_on_cpu), deepspeed's CheckpointHiddenStatesOffload (an outer saved-tensors hook), PEFT's
DoRA (the base weight read outside the base layer's forward), prompt tuning (every param in the
checkpointed layers frozen) and modules_to_save (trainable copies beside frozen originals).

Each checkpointed run equals the same run without checkpointing: the same losses and the same
trained params, bit for bit (bf16 runs the same ops either way), and nothing non-persistent is
left gathered after any step. On 0.14.5-0.19.2 stock crashes on every path with the checkpoint
(run with ZERO3_RECOMPUTE_DISABLE=1 to see it); there modules_to_save fails without checkpointing
too (a deepspeed bug fixed in 0.19.3), and is left out.

Mutation: HoldLedger.before_recompute_release returning no plan (a recompute's release as
stock's) fails every path on 0.19.2 with CheckpointError.
"""
import pytest

from tests.integration.checkpoint_paths import PATHS
from tests.unit.common import DistributedTest

LOSS_RTOL = 1e-6


@pytest.mark.hf
class TestCheckpointPaths(DistributedTest):
    world_size = 2
    timeout = 300

    @pytest.mark.lane
    @pytest.mark.parametrize("name", list(PATHS))
    def test_checkpointed_as_without(self, name):
        from tests.integration import checkpoint_paths
        from tests.integration.hf_families import assert_as_without
        from tests.integration.hf_runs import remove_shared, require_hf_stack, shared_directory

        require_hf_stack()
        reason = PATHS[name].unavailable()
        if reason:
            pytest.skip(reason)
        directory = shared_directory()
        try:
            checkpoint_paths.save_tiny_llama(directory)
            expected_losses, expected_moves = checkpoint_paths.run(name, directory, checkpointing=False)
            losses, moves = checkpoint_paths.run(name, directory, checkpointing=True)
        finally:
            remove_shared(directory)
        assert_as_without(name, losses, moves, expected_losses, expected_moves, LOSS_RTOL, move_rtol=1e-5,
                          move_atol=1e-8)
