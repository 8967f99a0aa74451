"""What the core and the forward watch note of each module, kept in the module's own __dict__.

NOTE [ Notes on the module ]

1. Rule 5's count of a module's calls whose backward release is due (lifecycle NOTE) and the
   forward watch's note of whether a call's output needs grad, with the graph task it was taken
   in (forward watch NOTE, rule 1), sit in the module's own __dict__, as deepspeed's own
   ds_grads_remaining and applied_pre_backward_ref_cnt do.
2. deepspeed's hook has just read that dict when ours runs, so a note there costs one warm look-up,
   where a table of our own keyed by id cost a cold one in every hook (docs/performance.md, the
   tenth round of issue #37).
3. Each ledger notes under keys of its own (NoteKeys), unique to its process too, so that a ledger
   after revert() and apply(), or in a process that unpickled a module, never reads what another
   left.
4. The values are plain (an int, a pair of ints and a bool): a deepcopy of a module carries at most
   a count too high, which holds as before rule 5, or the note of a graph task that is over (a
   graph task's id is never reused within a process), which nothing reads.
"""
import itertools
import os
from typing import NamedTuple

PREFIX = "_zero3_recompute_"
# Unique to this process (rule 3): graph task ids, and this module's count of ledgers, start again
# in every process, and a pickled module carries its notes into another.
_PROCESS = os.urandom(4).hex()

_ledgers = itertools.count()


class NoteKeys(NamedTuple):
    """The keys one ledger notes under in each module's __dict__ (rule 3)."""
    calls_due: str
    output: str


def new_keys() -> NoteKeys:
    """Keys no ledger of this process has used before."""
    number = next(_ledgers)
    return NoteKeys(f"{PREFIX}calls_due_{_PROCESS}_{number}", f"{PREFIX}output_{_PROCESS}_{number}")


def notes_on(module) -> dict:
    """The package's notes on ``module``, by key, for diagnostics and tests."""
    return {key: value for key, value in vars(module).items() if key.startswith(PREFIX)}
