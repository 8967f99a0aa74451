"""The repository's layout, as issue #17 set it: examples are leaves, shipped code cites only
files that ship with the repository.

Each check fails when its rule is broken: an `import examples...` or a sys.path insert of
examples/ under tests/, an examples/__init__.py, one example importing another, or a citation
in zero3_recompute/ of a docs page that does not exist or of the developers' shared notes.
"""
import ast
import os
import re

import pytest

pytestmark = pytest.mark.once_per_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python_files(folder: str):
    for directory, _, names in os.walk(os.path.join(ROOT, folder)):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def _imported_modules(path: str):
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_examples_are_leaves():
    assert not os.path.exists(os.path.join(ROOT, "examples", "__init__.py"))
    examples = {os.path.splitext(os.path.basename(path))[0] for path in _python_files("examples")}
    offenders = []
    for folder in ("tests", "zero3_recompute", "scripts", "examples"):
        for path in _python_files(folder):
            own = os.path.splitext(os.path.basename(path))[0]
            for module in _imported_modules(path):
                top = module.split(".")[0]
                if top == "examples" or (top in examples and top != own):
                    offenders.append(f"{os.path.relpath(path, ROOT)} imports {module}")
            with open(path) as handle:
                if re.search(r"sys\.path\.(insert|append)\([^)]*examples", handle.read()):
                    offenders.append(f"{os.path.relpath(path, ROOT)} puts examples/ on sys.path")
    assert offenders == []


def test_shipped_code_cites_only_what_the_repository_has():
    missing = []
    for path in _python_files("zero3_recompute"):
        with open(path) as handle:
            text = handle.read()
        where = os.path.relpath(path, ROOT)
        if re.search(r"\bNOTES\b", text):
            missing.append(f"{where} cites the developers' notes")
        for cited in re.findall(r"\bdocs/[\w./-]+\.(?:md|png)", text):
            if not os.path.exists(os.path.join(ROOT, cited)):
                missing.append(f"{where} cites {cited}, which does not exist")
    assert missing == []
