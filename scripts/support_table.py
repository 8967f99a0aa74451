"""Render the README's support table from the test suite's JUnit reports, one row per deepspeed
version of the matrix, and the releases each stands for (requirements/deepspeed-matrix.txt).

    .venv/bin/python scripts/support_table.py REPORT_DIR [OUTPUT]
    .venv/bin/python scripts/support_table.py REPORT_DIR --readme README.md

REPORT_DIR holds deepspeed-<version>.xml (the whole suite) and deepspeed-<version>-hf4.xml (the
HF tests on transformers 4.57), as scripts/test.sh writes them. With --readme, the table between
the README's support-table markers is replaced; nothing else in the file changes.
"""
import os
import re
import sys
import xml.etree.ElementTree as ElementTree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.unit.v1.zero.scenarios import BY_NAME, expected_stock  # noqa: E402
from zero3_recompute.versions import FIRST_UPSTREAM_HANDLED, parse  # noqa: E402

MATRIX = os.path.join(ROOT, "requirements", "deepspeed-matrix.txt")
START = "<!-- support-table:start (scripts/support_table.py) -->"
END = "<!-- support-table:end -->"
SEED = "torch_non_reentrant"


def matrix() -> dict:
    """{tested version: the releases it stands for}, in the matrix file's order."""
    found = {}
    with open(MATRIX, encoding="utf-8") as handle:
        for line in handle:
            version, _, comment = line.partition("#")
            if version.strip():
                found[version.strip()] = comment.strip() or version.strip()
    return found


def _cases(path: str) -> list:
    """(classname, name, outcome) of every test case in one JUnit file."""
    cases = []
    for case in ElementTree.parse(path).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        cases.append((case.get("classname", ""), case.get("name", ""), outcome))
    return cases


def _count(cases: list, keep) -> str:
    chosen = [outcome for classname, name, outcome in cases if keep(classname, name)]
    if not chosen:
        return "not run"
    failed, xfailed = chosen.count("failed"), chosen.count("xfailed")
    ran = len(chosen) - chosen.count("skipped")
    text = f"{ran - failed - xfailed}/{ran} pass" if not failed else f"**{failed} of {ran} fail**"
    return text + (f", {xfailed} xfail" if xfailed else "")


def _stock(version: str, cases: list) -> str:
    outcome = next((outcome for classname, name, outcome in cases
                    if classname.endswith("TestRecomputeScenarios") and name == f"test_stock_behaviour[{SEED}]"), None)
    upstream = parse(version) >= FIRST_UPSTREAM_HANDLED
    if outcome != "passed":
        return f"not observed ({outcome or 'not run'})"
    behaviour = expected_stock(BY_NAME[SEED], parse(version), upstream)
    text = {"crash": "CheckpointError", "ok": "trains"}.get(behaviour, behaviour)
    return f"deepspeed's own handling: {text}" if upstream else text


def _package(version: str) -> str:
    if parse(version) >= FIRST_UPSTREAM_HANDLED:
        return "patched, in place of deepspeed's own handling"
    return "patched"


def row(version: str, stands_for: str, report_dir: str) -> str:
    main = _cases(os.path.join(report_dir, f"deepspeed-{version}.xml"))
    hf4_path = os.path.join(report_dir, f"deepspeed-{version}-hf4.xml")
    hf4 = _cases(hf4_path) if os.path.exists(hf4_path) else []
    scenarios = _count(main, lambda classname, name: classname.endswith("TestRecomputeScenarios")
                       and name.startswith(("test_with_package[", "test_with_policy[")))
    hf = lambda classname, name: classname.startswith("tests.integration.")  # noqa: E731
    return " | ".join(["", version, stands_for, _stock(version, main), _package(version), scenarios,
                       _count(main, lambda classname, name: True), _count(main, hf), _count(hf4, hf), ""]).strip()


def render(report_dir: str) -> str:
    lines = [
        "| deepspeed (tested) | stands for | stock, non-reentrant checkpointing + frozen params | with zero3-recompute "
        "| scenario matrix with the package | whole suite | HF tests, transformers 5.24 | HF tests, transformers 4.57 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for version, stands_for in matrix().items():
        if os.path.exists(os.path.join(report_dir, f"deepspeed-{version}.xml")):
            lines.append(row(version, stands_for, report_dir))
    return "\n".join(lines) + "\n"


def replace_in(readme: str, table: str) -> None:
    with open(readme, encoding="utf-8") as handle:
        text = handle.read()
    pattern = re.compile(re.escape(START) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme}: expected the markers {START!r} ... {END!r}, found none")
    text = pattern.sub(lambda _: f"{START}\n{table}{END}", text)
    with open(readme, "w", encoding="utf-8") as handle:
        handle.write(text)


def main(argv) -> None:
    if len(argv) == 3 and argv[1] == "--readme":
        replace_in(argv[2], render(argv[0]))
    elif len(argv) in (1, 2):
        table = render(argv[0])
        if len(argv) == 2:
            with open(argv[1], "w", encoding="utf-8") as handle:
                handle.write(table)
        else:
            sys.stdout.write(table)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
