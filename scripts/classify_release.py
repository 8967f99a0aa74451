"""How the package classifies a deepspeed release (noxfile.py's newest session).

    python scripts/classify_release.py status
        prints "status|<mode>|<policy>|<detail>": zero3_recompute.status() once deepspeed's
        ZeRO-3 module is imported, or "status|no-deepspeed|-|<error>" where deepspeed fails to import;
    python scripts/classify_release.py verdict STATUS-LINE JUNIT-REPORT
        prints one verdict: patched and passing | patched, N failing | refused: <detail> | ...
"""
import importlib
import sys
import xml.etree.ElementTree as ElementTree


def status_line() -> str:
    import zero3_recompute

    try:
        importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    except Exception as exc:  # deepspeed itself failed to import: that is the detail
        return f"status|no-deepspeed|-|{type(exc).__name__}: {exc}"
    found = zero3_recompute.status()
    return f"status|{found.mode}|{found.policy}|{found.detail}"


def failures(report: str) -> int:
    suites = list(ElementTree.parse(report).getroot().iter("testsuite"))
    return sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites)


def verdict(line: str, report: str) -> str:
    fields = line.split("|", 3)
    if len(fields) != 4 or fields[0] != "status":
        raise SystemExit(f"expected a line status|MODE|POLICY|DETAIL, got {line!r}")
    _, mode, _, detail = fields
    failed = failures(report)
    if mode == "patched":
        return "patched and passing" if failed == 0 else f"patched, {failed} failing"
    if mode in ("mismatch", "unsupported"):
        return f"refused: {detail}"
    if mode == "upstream":
        return f"deepspeed's own handling in charge (policy upstream), {failed} failing"
    return f"not patched ({mode}): {detail}"


def main(argv) -> int:
    if argv[:1] == ["status"] and len(argv) == 1:
        print(status_line())
    elif argv[:1] == ["verdict"] and len(argv) == 3:
        print(verdict(argv[1], argv[2]))
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
