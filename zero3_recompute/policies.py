"""Release policies: what a frozen param's recompute release does. See NOTE [ Parameter
lifecycle under recompute ] in zero3_recompute.lifecycle, rule 1.

A policy answers one question for the ledger: a recompute is about to release module M's
frozen params, and M's output needs grad; is that recompute running under a saved-tensors
hook (torch's non-reentrant checkpoint, deepspeed's non_reentrant_checkpoint), which may
store the very Parameter object, or not (reentrant checkpointing, where autograd keeps its
own reference and stock's release is safe)? The answer is an action:

    HOLD         keep the param gathered until M's own backward (2 all-gathers per step)
    PLACEHOLDER  release it as stock does, and leave it a same-shape placeholder with no
                 storage, so the checkpoint's metadata check passes; M's backward gathers
                 it again (3 all-gathers per step, the no-checkpoint peak)
    STOCK        release it as stock does

Standard library only: the start-up hook reads the policy's name from the environment.
"""
import os
from dataclasses import dataclass
from typing import Container, Optional, Tuple

from zero3_recompute.errors import UnknownPolicy

ENV_POLICY = "ZERO3_RECOMPUTE_POLICY"

HOLD = "hold"
PLACEHOLDER = "placeholder"
STOCK = "stock"


@dataclass(frozen=True)
class Policy:
    name: str
    summary: str
    under_saved_tensors_hooks: str
    without_saved_tensors_hooks: str

    def mechanics(self, under_saved_tensors_hooks: bool, placeholders_on: bool) -> Optional[str]:
        """What a recompute release's frozen params get, decided once per policy (the ledger asks at
        each switch): None, stock's release; HOLD_ALL, every one held (PLACEHOLDER too, with the
        placeholders layer off); PLACEHOLDER_ALL, a placeholder each; BY_PARAM, each held but where
        split_by_param says it gets a placeholder."""
        action = self.under_saved_tensors_hooks if under_saved_tensors_hooks else self.without_saved_tensors_hooks
        if action == STOCK:
            return None
        if not placeholders_on:
            return HOLD_ALL
        return PLACEHOLDER_ALL if action == PLACEHOLDER else BY_PARAM


# Policy.mechanics' answers besides None.
HOLD_ALL, PLACEHOLDER_ALL, BY_PARAM = "hold all", "placeholder all", "by param"


def split_by_param(frozen: list, refused: Container[int]) -> Tuple[list, list]:
    """(to hold, to leave a placeholder) of a recompute release's ``frozen`` params under BY_PARAM.
    A param gets a placeholder where it would be held if it is swapped to NVMe (the swapper frees a
    swap-in buffer only when its param is partitioned, and has a few: buffer_count, 5 by default),
    or if its id is in ``refused``: past deepspeed's live-parameter limit (NOTE [ Holds within the
    live-parameter limit ])."""
    held, released = [], []
    for param in frozen:
        location = getattr(getattr(param, "ds_tensor", None), "final_location", None)  # swapped_to_nvme, in place
        (released if id(param) in refused or getattr(location, "value", location) == "nvme" else held).append(param)
    return held, released


def swapped_to_nvme(param) -> bool:
    """Whether deepspeed keeps this param's partition on NVMe (targets.FINAL_LOCATION): never held.
    split_by_param reads it in place, without a frame per param."""
    location = getattr(getattr(param, "ds_tensor", None), "final_location", None)
    return getattr(location, "value", location) == "nvme"


AUTO = Policy("auto", "keep under non-reentrant checkpointing, where stock crashes; stock's release under "
              "reentrant checkpointing, where stock trains on less memory", HOLD, STOCK)
KEEP = Policy("keep", "a frozen param gathered by a recompute stays gathered until its own module's backward: "
              "2 all-gathers per step, one checkpointed block held", HOLD, HOLD)
RELEASE = Policy("release", "frozen params are released after the recompute and gathered again by their module's "
                 "backward: 3 all-gathers per step, the no-checkpoint peak", PLACEHOLDER, STOCK)
# Where deepspeed's own handling (0.19.3 on) is switched off: under reentrant checkpointing it
# kept a recompute's frozen params for their module's backward too (2 all-gathers, a peak of
# one layer, or of every layer when the checkpoint wraps a layer's call), so keeping there
# matches its all-gathers at no more memory.
AUTO_IN_PLACE_OF_UPSTREAM = Policy("auto", "keep, under both checkpointing kinds: deepspeed's own handling kept "
                                   "under reentrant checkpointing too, at no less memory", HOLD, HOLD)
# deepspeed >= 0.19.3 (PR #8148): deepspeed's own handling stays in charge, nothing is patched.
UPSTREAM = "upstream"

PATCH_POLICIES = {policy.name: policy for policy in (AUTO, KEEP, RELEASE)}


def requested(name: Optional[str] = None) -> str:
    """The policy's name: ``name`` if given, else $ZERO3_RECOMPUTE_POLICY, else 'auto'."""
    if name is None:
        name = os.environ.get(ENV_POLICY, "").strip() or AUTO.name
    if not isinstance(name, str):
        raise UnknownPolicy(_choices(), f"{type(name).__name__} {name!r}")
    return name.strip().lower()


def for_patching(name: str, replaces_upstream: bool = False) -> Policy:
    """The policy to patch with, or UnknownPolicy saying which names this deepspeed takes.
    ``replaces_upstream``: deepspeed's own handling is installed and will be switched off."""
    if name == AUTO.name and replaces_upstream:
        return AUTO_IN_PLACE_OF_UPSTREAM
    policy = PATCH_POLICIES.get(name)
    if policy is None:
        detail = (f"{name!r}: 'upstream' leaves deepspeed >= 0.19.3's own handling in charge, and this deepspeed "
                  "has none" if name == UPSTREAM else repr(name))
        raise UnknownPolicy(_choices(), detail)
    return policy


def _choices() -> str:
    return "one of " + ", ".join(sorted(PATCH_POLICIES)) + f" (or {UPSTREAM} on deepspeed with its own handling)"
