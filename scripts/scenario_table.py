"""Render docs/scenarios.md from the test suite's JUnit reports: scenario x (deepspeed version,
torch), one column per report, by deepspeed version, then by torch release.

    .venv/bin/python scripts/scenario_table.py REPORT_DIR [OUTPUT]

REPORT_DIR holds deepspeed-<version>-torch-<torch>.xml files, as scripts/test.sh writes them (it
keeps them when ZERO3_REPORTS=DIR is set); other files there, such as the HF-only
deepspeed-<version>-torch-<torch>-hf4.xml, are left out. A column's torch and Python are its
report's testsuite properties (the torch falls back to the file name). A stock cell shows what
tests/unit/v1/zero/scenarios.py records for that version on that torch (the report's
torch_keeps_frozen property; "?" where it records none), but only where test_stock_behaviour
passed, i.e. stock deepspeed was seen to behave so in that run; a package cell shows the outcome
of test_with_package.
"""
import os
import re
import sys
import xml.etree.ElementTree as ElementTree
from typing import NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.unit.v1.zero.scenarios import SCENARIOS, expected_stock  # noqa: E402
from zero3_recompute.versions import FIRST_UPSTREAM_HANDLED, parse  # noqa: E402

CLASS = "TestRecomputeScenarios"
REPORT = re.compile(r"deepspeed-(?P<version>\d+(?:\.\d+)*)-torch-(?P<torch>\d+(?:\.\d+)*)\.xml")


class Column(NamedTuple):
    """One report's column: its deepspeed version, and what its testsuite properties say of the
    run (torch_keeps_frozen None where the report records none)."""
    path: str
    version: str
    torch: str
    python: Optional[str]
    torch_keeps_frozen: Optional[bool]

    def header(self) -> str:
        python = ".".join(self.python.split(".")[:2]) if self.python else "?"
        return f"{self.version} · torch {self.torch} · py{python}"


def _properties(path: str) -> dict:
    """{name: value} of the testsuite properties of one JUnit file (not the test cases' own)."""
    found = {}
    for suite in ElementTree.parse(path).getroot().iter("testsuite"):
        for properties in suite.findall("properties"):
            for prop in properties.findall("property"):
                found[prop.get("name")] = prop.get("value")
    return found


def _keeps_frozen(value: Optional[str]) -> Optional[bool]:
    """The torch_keeps_frozen property as a bool, None where the report records none."""
    return {"true": True, "false": False}.get((value or "").lower())


def _columns(report_dir: str) -> list:
    """A column per deepspeed-<version>-torch-<torch>.xml, by deepspeed version, then torch."""
    columns = []
    for name in os.listdir(report_dir):
        match = REPORT.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(report_dir, name)
        properties = _properties(path)
        columns.append(Column(path, match.group("version"), properties.get("torch") or match.group("torch"),
                              properties.get("python"), _keeps_frozen(properties.get("torch_keeps_frozen"))))
    return sorted(columns, key=lambda column: (parse(column.version), parse(column.torch)))


def _outcomes(path: str) -> dict:
    """{(test, scenario): (outcome, message)} from one JUnit file."""
    found = {}
    for case in ElementTree.parse(path).iter("testcase"):
        if not case.get("classname", "").endswith(CLASS):
            continue
        match = re.fullmatch(r"(test_\w+)\[(\w+)\]", case.get("name", ""))
        if match is None:
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, message = ("xfailed" if xfail else "skipped"), child.get("message", "")
        found[match.groups()] = (outcome, message)
    return found


def _stock(scenario, column: Column, stock_outcome: str) -> str:
    """What scenarios.py records for stock deepspeed in this column, where the run saw it so."""
    if stock_outcome != "passed":
        return f"{stock_outcome}?"
    if column.torch_keeps_frozen is None:
        return "?"
    # Released versions: deepspeed's own handling is installed from its first release on.
    upstream = parse(column.version) >= FIRST_UPSTREAM_HANDLED
    return expected_stock(scenario, parse(column.version), upstream, torch_keeps_frozen=column.torch_keeps_frozen)


def _cell(scenario, column: Column, results: dict) -> str:
    stock_outcome, _ = results.get(("test_stock_behaviour", scenario.name), ("missing", ""))
    package_outcome, message = results.get(("test_with_package", scenario.name), ("missing", ""))
    if package_outcome == "skipped":
        return "n/a"
    ours = "ok" if package_outcome == "passed" else f"**{package_outcome}**"
    return f"{_stock(scenario, column, stock_outcome)} → {ours}"


def render(report_dir: str) -> str:
    # Main reports only: the HF-only passes of other environments (deepspeed-<version>-torch-<torch>-hf4.xml)
    # run no scenario and would add a column per version.
    columns = _columns(report_dir)
    results = {column: _outcomes(column.path) for column in columns}
    lines = [
        "# Scenario × deepspeed version",
        "",
        "Generated by `scripts/scenario_table.py` from one run of `scripts/test.sh` on CPU (2 ranks, gloo).",
        "Each column is one deepspeed version on one torch; the torch and Python of each come from that",
        "run's report, and so does whether that torch's checkpoint keeps the frozen tensors the recompute",
        "saved (torch 2.4 keeps a detached alias of every tensor instead), which decides what stock does.",
        "Each cell: stock deepspeed's behaviour → behaviour with zero3-recompute. `crash`: an exception in",
        "backward; `leak`: trains, but params stay gathered after backward (until `step()`), or the",
        "coordinator's count of gathered params is left off after an aborted backward; `ok`: trains,",
        "matches a plain-torch reference, nothing left gathered. `n/a`: the version or the CPU accelerator",
        "cannot express the scenario (the test says why). From 0.19.3 \"stock\" is deepspeed's own recompute",
        "handling (PR #8148), which the package switches off and replaces; there the matrix also passes",
        "under the keep and release policies (`test_with_policy`).",
        "",
        "| scenario | what it covers | " + " | ".join(column.header() for column in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for scenario in SCENARIOS:
        cells = [_cell(scenario, column, results[column]) for column in columns]
        lines.append(f"| `{scenario.name}` | {scenario.group}: {scenario.summary} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    table = render(sys.argv[1])
    if len(sys.argv) == 3:
        with open(sys.argv[2], "w") as handle:
            handle.write(table)
    else:
        sys.stdout.write(table)


if __name__ == "__main__":
    main()
