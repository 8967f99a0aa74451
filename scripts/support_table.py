"""Render the support table (docs/support.md) from the test suite's JUnit reports, one row per report of
a deepspeed version of the matrix (requirements/deepspeed-matrix.txt, and the releases each
stands for) on one torch, in the matrix file's order, then by torch release.

    python scripts/support_table.py REPORT_DIR [OUTPUT]
    python scripts/support_table.py REPORT_DIR --readme docs/support.md
(noxfile.py's report session runs it; the full tier's regenerates docs/support.md)

REPORT_DIR holds what noxfile.py's test sessions write there: deepspeed-<version>-torch-<torch>.xml (the
whole suite of that pairing), deepspeed-<version>-torch-<torch>-hf4.xml (the main torch of
requirements/torch.txt only: the HF tests on transformers 4.57, the main report running the
transformers 5 stack), and torch-<torch>.hf for every other torch (which HF stack installed in
its venv, "transformers 4.57.1" or "transformers 5.24.0", or a line starting "neither HF stack
installs" saying why none did). There the main report's HF tests go under the column of the
transformers major version named; the other column is left empty, and a torch without a .hf
file shows "not run" in both. The torch, Python and torch_keeps_frozen of a row are the
report's testsuite properties (the torch falls back to the file name); torch_keeps_frozen
decides what tests/unit/v1/zero/scenarios.py records for stock deepspeed. The "with
zero3-recompute" column is the report's patch_mode and switched_off (status() at the start of
the run; by deepspeed's version in reports older than those properties). With --readme, the
table between the file's support-table markers is replaced; nothing else in the file changes.
"""
import os
import re
import sys
import xml.etree.ElementTree as ElementTree
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.unit.v1.zero.scenarios import BY_NAME, expected_stock  # noqa: E402
from zero3_recompute.versions import FIRST_UPSTREAM_HANDLED, parse  # noqa: E402

from junit_reports import Report, main_reports  # noqa: E402  (this script's own folder)

MATRIX = os.path.join(ROOT, "requirements", "deepspeed-matrix.txt")
MAIN_TORCH_FILE = os.path.join(ROOT, "requirements", "torch.txt")
START = "<!-- support-table:start (scripts/support_table.py) -->"
END = "<!-- support-table:end -->"
SEED = "torch_non_reentrant"
HF_STACK = re.compile(r"transformers (?P<major>\d+)\.")
NO_HF_STACK = "neither HF stack installs"
EMPTY = "—"
# What the table says for each stock outcome of scenarios.py.
STOCK_WORDS = {"crash": "CheckpointError", "ok": "trains", "leak": "trains, leaks gathered params"}
MIXED_DTYPE_LAYER = "mixed_dtype_gather"


def matrix() -> dict:
    """{tested version: the releases it stands for}, in the matrix file's order."""
    found = {}
    with open(MATRIX, encoding="utf-8") as handle:
        for line in handle:
            fields, _, comment = line.partition("#")
            if fields.split():  # the version, then its tier
                version = fields.split()[0]
                found[version] = comment.strip() or version
    return found


def main_torch() -> str:
    """The torch of the main environment (requirements/torch.txt), the one with an -hf4 report."""
    with open(MAIN_TORCH_FILE, encoding="utf-8") as handle:
        for line in handle:
            match = re.match(r"torch==([\d.]+)", line.strip())
            if match:
                return match.group(1)
    raise SystemExit(f"{MAIN_TORCH_FILE}: no torch==X line")


def reports(report_dir: str) -> list:
    """Every main report of REPORT_DIR for a deepspeed version of the matrix, in the matrix
    file's order, then by torch release."""
    order = list(matrix())
    found = [report for report in main_reports(report_dir) if report.version in order]
    return sorted(found, key=lambda report: (order.index(report.version), parse(report.torch)))


def _cases(path: str) -> list:
    """(classname, name, outcome) of every test case in one JUnit file; none if it is absent."""
    if not os.path.exists(path):
        return []
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


def _is_hf(classname: str, name: str) -> bool:
    return classname.startswith("tests.integration.")


def _stock(report: Report, cases: list) -> str:
    outcome = next((outcome for classname, name, outcome in cases
                    if classname.endswith("TestRecomputeScenarios") and name == f"test_stock_behaviour[{SEED}]"), None)
    upstream = parse(report.version) >= FIRST_UPSTREAM_HANDLED
    if outcome != "passed":
        return f"not observed ({outcome or 'not run'})"
    if report.torch_keeps_frozen is None:
        return "unknown (the report records no torch_keeps_frozen)"
    behaviour = expected_stock(BY_NAME[SEED], parse(report.version), upstream,
                               torch_keeps_frozen=report.torch_keeps_frozen)
    text = STOCK_WORDS.get(behaviour, behaviour)
    return f"deepspeed's own handling: {text}" if upstream else text


def _package(report: Report) -> str:
    """What status() said in that run; by deepspeed's version for reports that do not record it."""
    if report.patch_mode is None:
        return "patched, in place of deepspeed's own handling" if parse(report.version) >= FIRST_UPSTREAM_HANDLED \
            else "patched"
    text = report.patch_mode
    if report.patch_mode == "patched" and report.switched_off:
        text = "patched, in place of deepspeed's own handling"
    if MIXED_DTYPE_LAYER in (report.layers or "").split(","):
        text += "; mixed-dtype gather fixed"
    return text


def _stock_bf16(report: Report, cases: list) -> str:
    """Stock deepspeed with a bf16 model and PEFT's fp32 adapters: TestMixedDtypeGather::test_stock
    passed, having seen the crash where that deepspeed's code has deepspeed #8072 and training
    elsewhere."""
    outcome = next((outcome for classname, name, outcome in cases
                    if classname.endswith("TestMixedDtypeGather") and name == "test_stock"), None)
    if outcome != "passed" or report.mixed_dtype_gather_needed is None:
        return f"not observed ({outcome or 'not run'})"
    return "crashes at the first step (#8072)" if report.mixed_dtype_gather_needed else "trains"


def _hf_stack(report_dir: str, torch: str) -> Optional[str]:
    """The line torch-<torch>.hf holds (which HF stack that torch's venv has), None without one."""
    path = os.path.join(report_dir, f"torch-{torch}.hf")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return handle.readline().strip()


def _hf_columns(report: Report, cases: list, report_dir: str) -> tuple:
    """(transformers 5.x cell, transformers 4.57 cell) of one row."""
    if report.named_torch == main_torch():
        return _count(cases, _is_hf), _count(_cases(report.path[:-len(".xml")] + "-hf4.xml"), _is_hf)
    stack = _hf_stack(report_dir, report.named_torch)
    if stack is None:
        return "not run", "not run"
    if stack.startswith(NO_HF_STACK):
        none = f"no HF stack for torch {report.torch} / Python {report.short_python()}"
        return none, none
    match = HF_STACK.match(stack)
    if match is None or match.group("major") not in ("4", "5"):
        raise SystemExit(f"torch-{report.named_torch}.hf: expected 'transformers 4.x', 'transformers 5.x' "
                         f"or '{NO_HF_STACK} ...', found {stack!r}")
    hf = _count(cases, _is_hf)
    return (hf, EMPTY) if match.group("major") == "5" else (EMPTY, hf)


def row(report: Report, stands_for: str, report_dir: str) -> str:
    main = _cases(report.path)
    scenarios = _count(main, lambda classname, name: classname.endswith("TestRecomputeScenarios")
                       and name.startswith(("test_with_package[", "test_with_policy[")))
    return " | ".join(["", report.version, report.torch, report.short_python(), stands_for, _stock(report, main),
                       _stock_bf16(report, main), _package(report), scenarios, _count(main, lambda classname, name: True),
                       *_hf_columns(report, main, report_dir), ""]).strip()


def render(report_dir: str) -> str:
    lines = [
        "| deepspeed (tested) | torch | Python | stands for | stock, non-reentrant checkpointing + frozen params "
        "| stock, bf16 LoRA (PEFT's fp32 adapters) | with zero3-recompute | scenario matrix with the package "
        "| whole suite | HF tests, transformers 5.x | HF tests, transformers 4.57 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stands_for = matrix()
    for report in reports(report_dir):
        lines.append(row(report, stands_for[report.version], report_dir))
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
