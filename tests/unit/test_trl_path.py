"""doctor's reading of TRL and transformers (zero3_recompute.trl_path): what each source says,
the flavour a user's ``gradient_checkpointing=True`` with no kwargs trains with, and doctor's
lines for the installed stack.

Mutation: forced_into returning None (TRL read as forcing nothing) fails
test_trl_forcing_read_from_source.
"""
import ast
import subprocess
import sys

import pytest

from zero3_recompute import trl_path
from zero3_recompute.trl_path import StackFacts

TRL_FORCING = '''
class SFTTrainer:
    def __init__(self, args):
        if args.gradient_checkpointing:
            args.gradient_checkpointing_kwargs = args.gradient_checkpointing_kwargs or {}
            args.gradient_checkpointing_kwargs["use_reentrant"] = True
'''
TRL_SETTING_DEFAULT = '''
def prepare(args):
    args.gradient_checkpointing_kwargs.setdefault("use_reentrant", False)
    args.gradient_checkpointing_kwargs["use_reentrant"] = False
'''
TRAINER_5 = '''
class Trainer:
    def train(self):
        kwargs = dict(self.args.activation_checkpointing_kwargs or {})
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
'''
TRAINER_4 = '''
class Trainer:
    def _inner_training_loop(self, args):
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
'''
MODELING_5 = '''
class PreTrainedModel:
    def _activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        if activation_checkpointing_kwargs is None:
            activation_checkpointing_kwargs = {"use_reentrant": False}
'''


def test_trl_forcing_read_from_source():
    assert trl_path.forced_into([ast.parse(TRL_FORCING)]) == "gradient_checkpointing_kwargs"
    assert trl_path.forced_into([ast.parse(TRL_SETTING_DEFAULT)]) is None, "a False default is no force"


def test_trainer_and_default_read_from_source():
    assert trl_path.train_reads(ast.parse(TRAINER_5)) == {"activation_checkpointing_kwargs"}, \
        "a keyword argument's name is not a read"
    assert trl_path.train_reads(ast.parse(TRAINER_4)) == {"gradient_checkpointing_kwargs"}
    assert trl_path.unset_reentrant(ast.parse(MODELING_5)) is False


@pytest.mark.parametrize("kind, crash", [("patch", True), ("upstream", False)])
def test_a_lost_force_is_named_with_its_meaning(kind, crash):
    facts = StackFacts("1.16.0", "5.24.0", "gradient_checkpointing_kwargs", {"activation_checkpointing_kwargs"}, False)
    text = "\n".join(trl_path.describe(facts, kind, fix_active=True))
    assert "TRL's force is lost" in text and "SFT trains non-reentrant" in text
    assert ("stock crashes (CheckpointError)" in text) is crash
    assert "the package trains them" in text


def test_a_force_that_holds_and_no_force():
    held = StackFacts("1.16.0", "4.57.1", "gradient_checkpointing_kwargs", {"gradient_checkpointing_kwargs"}, True)
    assert "TRL's force holds, reentrant" in "\n".join(trl_path.describe(held, "patch", fix_active=False))
    none = StackFacts("0.24.0", "4.57.1", None, {"gradient_checkpointing_kwargs"}, True)
    text = "\n".join(trl_path.describe(none, "patch", fix_active=False))
    assert "forces no use_reentrant" in text and "kwargs unset: reentrant" in text
    assert "(it is NOT active)" in text


@pytest.mark.hf
@pytest.mark.lane(newest_only=True)
def test_doctor_names_the_installed_path():
    """doctor's lines on this machine's stack agree with what its sources say."""
    facts = trl_path.read_installed()
    if facts.transformers is None or facts.trl is None:
        pytest.skip("transformers or TRL is not installed")
    done = subprocess.run([sys.executable, "-m", "zero3_recompute", "doctor", "--no-reproduce"], capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("TRL", "transformers"))]
    assert any(line.startswith(f"transformers {facts.transformers}: train() enables checkpointing from")
               for line in lines), done.stdout
    lost = facts.forced_into is not None and facts.forced_into not in (facts.train_reads or ())
    assert any("TRL's force is lost" in line for line in lines) is lost, lines
    assert facts.forced_into is not None or any("forces no use_reentrant" in line for line in lines), lines
