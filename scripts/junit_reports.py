"""The main JUnit reports noxfile.py's test sessions write, and what each records of its run; shared by
scripts/support_table.py and scripts/scenario_table.py.

A main report is deepspeed-<version>-torch-<torch>.xml (the HF-only -hf4 passes are not). Its
testsuite properties (tests/conftest.py) give the torch, the Python, and whether that torch's
checkpoint keeps the very frozen tensors the recompute saved (zero3_recompute.torch_recompute),
and what zero3_recompute.status() said at the start of the run (patch_mode, switched_off, layers).
"""
import os
import re
import xml.etree.ElementTree as ElementTree
from typing import List, NamedTuple, Optional

REPORT = re.compile(r"deepspeed-(?P<version>\d+(?:\.\d+)*)-torch-(?P<torch>\d+(?:\.\d+)*)\.xml")


class Report(NamedTuple):
    """One main report: its deepspeed version, the torch its file is named for (the name of its
    sibling files), and what its testsuite properties say of the run (torch falls back to the
    file name; python, torch_keeps_frozen, patch_mode and switched_off are None where the report
    records none: reports written before conftest recorded them)."""
    path: str
    version: str
    named_torch: str
    torch: str
    python: Optional[str]
    torch_keeps_frozen: Optional[bool]
    # status().mode, and its switched_off pieces (comma-separated), at the start of the run.
    patch_mode: Optional[str] = None
    switched_off: Optional[str] = None
    # status().layers (comma-separated): the optional layers installed, e.g. mixed_dtype_gather.
    layers: Optional[str] = None
    # Whether that deepspeed's code has deepspeed #8072, the mixed-dtype list gather (true/false).
    mixed_dtype_gather_needed: Optional[bool] = None

    def short_python(self, unknown: str = "unknown") -> str:
        """'3.10' of a Python version such as '3.10.13'."""
        return ".".join(self.python.split(".")[:2]) if self.python else unknown


def _properties(path: str) -> dict:
    """{name: value} of the testsuite properties of one JUnit file (not the test cases' own)."""
    found = {}
    for suite in ElementTree.parse(path).getroot().iter("testsuite"):
        for properties in suite.findall("properties"):
            for prop in properties.findall("property"):
                found[prop.get("name")] = prop.get("value")
    return found


def main_reports(report_dir: str) -> List[Report]:
    """Every main report in REPORT_DIR, in no particular order."""
    found = []
    for name in os.listdir(report_dir):
        match = REPORT.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(report_dir, name)
        properties = _properties(path)
        keeps = {"true": True, "false": False}.get((properties.get("torch_keeps_frozen") or "").lower())
        found.append(Report(path, match.group("version"), match.group("torch"),
                            properties.get("torch") or match.group("torch"), properties.get("python"), keeps,
                            properties.get("patch_mode"), properties.get("switched_off"), properties.get("layers"),
                            {"true": True, "false": False}.get(properties.get("mixed_dtype_gather_needed") or "")))
    return found
