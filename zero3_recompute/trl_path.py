"""Which checkpoint flavour TRL and transformers, as installed, train with, for ``doctor``.

Read from their sources (never imported): TRL 0.28 on forces ``use_reentrant=True`` for PEFT +
ZeRO-3 by writing one of the trainer arguments' kwargs; ``Trainer.train()`` enables checkpointing
from the kwargs it reads (transformers 5.24 on: ``activation_checkpointing_kwargs`` only); left
unset, ``*checkpointing_enable`` takes a default (``use_reentrant`` False on 5.x, True on 4.x).
A user who writes ``gradient_checkpointing=True`` and no kwargs gets a fresh dict from TRL under
the name train() does not read, so the force is lost; DPO and GRPO re-enable checkpointing mid-run
with TRL's dict, which is reentrant.
"""
import ast
import importlib.util
import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Iterable, Optional, Set

KWARGS_NAMES = ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")
TRAIN_METHODS = ("train", "_inner_training_loop")
FLAVOURS = {True: "reentrant", False: "non-reentrant", None: "unknown"}


@dataclass(frozen=True)
class StackFacts:
    """What the installed sources say; None where a source cannot be read."""
    trl: Optional[str]
    transformers: Optional[str]
    forced_into: Optional[str]  # the kwargs TRL writes use_reentrant=True into; None: it forces nothing
    train_reads: Optional[Set[str]]  # the kwargs Trainer.train() reads
    unset_reentrant: Optional[bool]  # use_reentrant where the kwargs are left unset


def _installed(distribution: str) -> Optional[str]:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _package_files(package: str, *relative: str) -> Iterable[str]:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = list(spec.submodule_search_locations)[0]
    found = []
    for part in relative:
        path = os.path.join(root, part)
        if os.path.isdir(path):
            found.extend(os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".py"))
        elif os.path.isfile(path):
            found.append(path)
    return found


def _parse(path: str) -> Optional[ast.AST]:
    try:
        with open(path, encoding="utf-8") as source:
            return ast.parse(source.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def forced_into(trees: Iterable[ast.AST]) -> Optional[str]:
    """The kwargs name in an assignment ``<x>.<name>["use_reentrant"] = True``, if any."""
    for tree in trees:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is True):
                continue
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant)
                        and target.slice.value == "use_reentrant" and isinstance(target.value, ast.Attribute)
                        and target.value.attr in KWARGS_NAMES):
                    return target.value.attr
    return None


def train_reads(tree: ast.AST) -> Set[str]:
    """The kwargs names Trainer's train() and _inner_training_loop read as attributes."""
    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name in TRAIN_METHODS:
                    read.update(sub.attr for sub in ast.walk(method)
                                if isinstance(sub, ast.Attribute) and sub.attr in KWARGS_NAMES)
    return read


def unset_reentrant(tree: ast.AST) -> Optional[bool]:
    """The ``use_reentrant`` of the dict a ``*checkpointing_enable`` method falls back to."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("checkpointing_enable"):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict):
                    for key, value in zip(sub.keys, sub.values):
                        if (isinstance(key, ast.Constant) and key.value == "use_reentrant"
                                and isinstance(value, ast.Constant) and isinstance(value.value, bool)):
                            return value.value
    return None


def read_installed() -> StackFacts:
    trl, transformers = _installed("trl"), _installed("transformers")
    forced = None
    if trl is not None:
        forced = forced_into(tree for tree in map(_parse, _package_files("trl", "trainer")) if tree is not None)
    reads, unset = None, None
    if transformers is not None:
        trainer = [tree for tree in map(_parse, _package_files("transformers", "trainer.py")) if tree is not None]
        modeling = [tree for tree in map(_parse, _package_files("transformers", "modeling_utils.py")) if tree is not None]
        reads = train_reads(trainer[0]) if trainer else None
        unset = unset_reentrant(modeling[0]) if modeling else None
    return StackFacts(trl, transformers, forced, reads, unset)


def describe(facts: StackFacts, deepspeed_kind: str, fix_active: bool) -> list:
    """doctor's lines: what TRL and transformers do, the flavour a user's ``gradient_checkpointing=True``
    with no kwargs trains with, and what that means on the installed deepspeed (``deepspeed_kind``:
    versions.classify's "patch", "upstream" or other)."""
    if facts.transformers is None:
        return ["TRL path    transformers is not installed"]
    reads = ", ".join(sorted(facts.train_reads)) if facts.train_reads else "unknown kwargs"
    lines = [f"transformers {facts.transformers}: train() enables checkpointing from {reads}; left unset, "
             f"{FLAVOURS[facts.unset_reentrant]}"]
    if facts.trl is None:
        lines.append("TRL         not installed")
        return lines
    if facts.forced_into is None:
        lines.append(f"TRL         {facts.trl}: forces no use_reentrant")
        first, later = facts.unset_reentrant, facts.unset_reentrant
        path = f"kwargs unset: {FLAVOURS[first]}, transformers' default"
    else:
        lines.append(f"TRL         {facts.trl}: forces use_reentrant=True for PEFT + ZeRO-3, into args.{facts.forced_into}")
        if facts.train_reads is not None and facts.forced_into not in facts.train_reads:
            first, later = facts.unset_reentrant, True
            path = (f"kwargs unset: TRL's force is lost (train() reads {reads}): SFT trains "
                    f"{FLAVOURS[first]}; DPO from its second step and GRPO from its first generation train "
                    f"reentrant (TRL re-enables checkpointing with its dict); a non-empty "
                    f"{facts.forced_into} passed at construction keeps the force")
        else:
            first, later = True, True
            path = "kwargs unset or not: TRL's force holds, reentrant"
    lines.append(f"TRL path    gradient_checkpointing=True, {path}")
    lines.append("            " + _meaning({first, later}, deepspeed_kind, fix_active))
    return lines


def _meaning(flavours: set, deepspeed_kind: str, fix_active: bool) -> str:
    package = "the package trains them" + ("" if fix_active else ", once active (it is NOT active)")
    if deepspeed_kind == "patch":
        if False in flavours:
            return f"on this deepspeed stock crashes (CheckpointError) on the non-reentrant steps; {package}"
        return f"on this deepspeed stock trains reentrant steps, gathering frozen params 3 times a step; {package}, at 2"
    if deepspeed_kind == "upstream":
        return ("on this deepspeed its own handling trains these steps, gathering frozen params about 2.8 times a "
                f"step; {package}, at 2")
    return "this deepspeed is outside the range the package supports"
