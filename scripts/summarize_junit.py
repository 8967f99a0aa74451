"""Print one closing line over every deepspeed version's junit report."""
import pathlib
import sys
import xml.etree.ElementTree as ElementTree


def main(folder: str) -> int:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    reports = sorted(pathlib.Path(folder).glob("*.xml"))
    for report in reports:
        for suite in ElementTree.parse(report).getroot().iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    print(f"total: {passed} passed, {failed} failed, {totals['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
