"""The configurations the benchmark runs side by side.

    no-checkpoint   stock deepspeed without activation checkpointing: the reference
    no-checkpoint patched
                    the same under the package (default policy): a backward that no
                    checkpoint ran in takes stock's path, so its counts, bytes and losses are
                    the reference's and its time ratio is against it
    stock           the package reverted, non-reentrant checkpointing; where deepspeed has
                    its own handling (0.19.3 on) that is what runs, and the row is 'upstream'
    trl             TRL's forced path for PEFT + ZeRO-3 on stock: reentrant, input grads on
    <policy>        each release policy of the package (auto, keep, release), non-reentrant,
                    and reentrant with input grads on
    auto limit <L>  with --live-limits: auto, non-reentrant, stage3_max_live_parameters at L
                    checkpointed layers' frozen numel (NOTE [ Holds within the live-parameter
                    limit ]), at the first placement
"""
import math
from dataclasses import dataclass
from typing import List, Optional

from zero3_recompute import policies

REFERENCE = "reference"
PATCHED_REFERENCE = "reference-patched"
STOCK = "stock"
TRL = "trl"
POLICY = "policy"
BUDGET = "budget"


@dataclass(frozen=True)
class Config:
    name: str
    role: str  # REFERENCE, PATCHED_REFERENCE, STOCK, TRL, POLICY or BUDGET
    # A policy of the package, or None: the package reverted (stock deepspeed, or deepspeed's
    # own handling where it has one).
    policy: Optional[str]
    # None: no checkpointing; else torch's checkpoint with use_reentrant=reentrant.
    reentrant: Optional[bool]
    placement: Optional[str]
    # stage3_max_live_parameters in one checkpointed layer's frozen numel (math.inf: deepspeed's
    # default); None: deepspeed's default, outside the sweep.
    live_limit: Optional[float] = None

    @property
    def finite_live_limit(self) -> Optional[float]:
        """``live_limit`` where it sets stage3_max_live_parameters; None for deepspeed's default."""
        return None if self.live_limit is None or math.isinf(self.live_limit) else self.live_limit

    @property
    def checkpointing(self) -> str:
        return {None: "none", True: "reentrant", False: "non-reentrant"}[self.reentrant]


def limit_label(limit: float) -> str:
    return "unlimited" if math.isinf(limit) else f"{limit:g}"


def configurations(placements: List[str], upstream_installed: bool, live_limits=()) -> List[Config]:
    """Every configuration, per placement, then the budget sweep; the reference first."""
    found = [Config("no-checkpoint", REFERENCE, None, None, None),
             Config("no-checkpoint patched", PATCHED_REFERENCE, policies.AUTO.name, None, None)]
    for placement in placements:
        suffix = f" [{placement}]" if len(placements) > 1 else ""
        found += [Config(("upstream" if upstream_installed else "stock") + suffix, STOCK, None, False, placement),
                  Config(f"trl{suffix}", TRL, None, True, placement)]
        for policy in sorted(policies.PATCH_POLICIES):
            found += [Config(f"{policy}{suffix}", POLICY, policy, False, placement),
                      Config(f"{policy} reentrant{suffix}", POLICY, policy, True, placement)]
    found += [Config(f"auto limit {limit_label(limit)}", BUDGET, policies.AUTO.name, False, placements[0], limit)
              for limit in live_limits]
    return found
