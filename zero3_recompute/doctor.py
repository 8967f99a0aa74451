"""``python -m zero3_recompute doctor``: am I affected, and is the fix active?

Judged two ways: by the installed deepspeed's version, and by running the bug's tiny
reproduction (zero3_recompute.reproduce) in a subprocess, on stock deepspeed and with the
package. Exit code: 0 when not affected or the fix is active, 1 when affected and the fix is
not active, 2 when the check itself could not run.
"""
import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import List, Optional, Tuple

from zero3_recompute import trl_path, versions
from zero3_recompute.autoload import ENV_DISABLE
from zero3_recompute.patch import REFUSALS

EXIT_OK = 0
EXIT_AFFECTED = 1
EXIT_ERROR = 2
REPRODUCTION_TIMEOUT_S = 600
# Where deepspeed's own handling (0.19.3 on) still crashes, by our scenario matrix (docs/scenarios.md).
UPSTREAM_GAPS = ("torch.utils.checkpoint.set_checkpoint_early_stop(False)",
                 "fast leaf sharding (stage3_module_granularity_threshold)",
                 "deepspeed.checkpointing.non_reentrant_checkpoint")


def _installed(distribution: str) -> Optional[str]:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _by_version(deepspeed_version: str) -> str:
    kind = versions.classify(versions.parse(deepspeed_version))
    if kind == "patch":
        return "affected (deepspeed 0.14.5-0.19.2 partition frozen params inside a checkpoint recompute)"
    if kind == "upstream":
        return (f"deepspeed >= {versions.render(versions.FIRST_UPSTREAM_HANDLED)} ships its own handling "
                "(PR #8148), with known gaps; the package takes over from it unless the policy is 'upstream'")
    return f"unknown: deepspeed {deepspeed_version} is outside the range this package supports ({versions.at_least()})"


def _start_reproduction() -> subprocess.Popen:
    """The reproduction in a subprocess, started before the doctor imports torch itself, so that
    the two interpreters' start-up overlaps."""
    return subprocess.Popen([sys.executable, "-m", "zero3_recompute.reproduce"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _reproduction_report(reproduction: subprocess.Popen) -> dict:
    """What the reproduction reported, read within REPRODUCTION_TIMEOUT_S."""
    stdout, stderr = reproduction.communicate(timeout=REPRODUCTION_TIMEOUT_S)
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = "\n".join((stderr or stdout).strip().splitlines()[-5:])
    raise RuntimeError(f"the reproduction exited with {reproduction.returncode} and no report:\n{tail}")


def _probe_and_reproduce(reproduce: bool) -> Tuple[Optional[bool], Optional[dict], Optional[str]]:
    """(whether torch's checkpoint keeps frozen tensors, the reproduction's report, why it failed
    to run): the reproduction is started first, so that its interpreter's start-up overlaps the
    probe's import of torch here, and killed if it is still running when this returns or raises."""
    reproduction = _start_reproduction() if reproduce else None
    try:
        torch_affected = _torch_keeps_frozen_tensors()
        if reproduction is None:
            return torch_affected, None, None
        try:
            return torch_affected, _reproduction_report(reproduction), None
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            return torch_affected, None, str(exc)
    finally:
        if reproduction is not None and reproduction.poll() is None:
            reproduction.kill()
            reproduction.communicate()


def _describe_step(result: Optional[dict]) -> str:
    if result is None:
        return "not run"
    if result["outcome"] == "ok":
        return f"trains ({result['seconds']} s)"
    return f"crashes: {result['error']}"


def run(reproduce: bool = True) -> int:
    lines: List[str] = []
    torch_version, deepspeed_version = _installed("torch"), _installed("deepspeed")
    lines.append(f"zero3-recompute {_installed('zero3-recompute') or 'not installed as a distribution'}")
    lines.append(f"python      {sys.version.split()[0]}")
    lines.append(f"torch       {torch_version or 'not installed'}")
    lines.append(f"deepspeed   {deepspeed_version or 'not installed'}")
    if deepspeed_version is None or torch_version is None:
        print("\n".join(lines + ["verdict: cannot check without torch and deepspeed"]))
        return EXIT_ERROR
    lines.append(f"by version  {_by_version(deepspeed_version)}")
    torch_affected, report, failure = _probe_and_reproduce(reproduce)
    lines.append(f"by torch    {_by_torch(torch_version, torch_affected)}")
    if failure is not None:
        lines.append(f"reproduction failed to run: {failure}")
    if report is not None:
        lines.append(f"accelerator {report['accelerator']}")
        lines.append(f"stock       {_describe_step(report['stock'])}   (1-rank CPU reproduction, patch off)")
        status = report["status"]
        refused = status["mode"] in REFUSALS and report.get("with_package") is None
        lines.append("package     " + ("not run: the package refused to patch" if refused
                                       else _describe_step(report.get("with_package"))))
    else:
        status = _status_in_process()
    lines.append(f"fix         {'active' if status['active'] else 'NOT active'}: {status['mode']}"
                 + (f", policy {status['policy']}" if status["policy"] else ""))
    if status["mechanism"]:
        lines.append(f"hooks       saved-tensors hooks read by {status['mechanism']}")
    if status["active"]:
        lines.append("storage     gathered storage kept outside saved tensors (bitsandbytes 4-bit): "
                     + ("freed and refilled" if status.get("frees_kept_storage") else
                        "left as stock keeps it (this torch cannot count a storage's references)"))
        lines.append("layers      " + (", ".join(status.get("layers") or ()) or "none"))
    if status.get("gather_fix"):
        lines.append(f"gather      mixed-dtype list gathers (deepspeed #8072): {status['gather_fix']}")
    if status["mode"] in REFUSALS and status.get("refusal"):
        lines.append(f"refused     {status['refusal']}")
    elif not status["active"]:
        lines.append(f"            {status['detail']}")
    if status["mode"] in REFUSALS:
        lines.append(f"works with  {versions.working_pairings()}")
    if status["active"]:
        lines.append(f"to turn it off: set {ENV_DISABLE}=1 before starting Python, or call zero3_recompute.revert(); "
                     "pip uninstall zero3-recompute removes it")
    elif status["mode"] == "not-applied":
        lines.append(f"to turn it on: unset {ENV_DISABLE}, or call zero3_recompute.apply()")

    lines.extend(trl_path.describe(trl_path.read_installed(), versions.classify(versions.parse(deepspeed_version)),
                                   bool(status["active"])))
    if reproduce and report is None and status["mode"] not in REFUSALS:
        print("\n".join(lines + ["verdict: unknown"]))
        return EXIT_ERROR
    affected = _affected(deepspeed_version, torch_affected, report)
    if status["mode"] == "upstream":
        lines.append(f"handling    deepspeed's own, in charge; it still crashes with {'; '.join(UPSTREAM_GAPS)} "
                     "(docs/scenarios.md)")
        verdict, code = "deepspeed's own handling in charge, with known gaps", EXIT_OK
    elif status["active"] and status["switched_off"]:
        lines.append("handling    the package's, in place of deepspeed's own (switched off while patched)")
        verdict, code = "fix active, in place of deepspeed's own handling", EXIT_OK
    elif status["mode"] in REFUSALS:
        verdict = "affected, fix NOT active: the package refused to patch" if affected else \
            "not affected; the package refused to patch"
        code = EXIT_AFFECTED if affected else EXIT_OK
    elif not affected:
        verdict, code = ("not affected by the crash, fix active" if status["active"] else "not affected"), EXIT_OK
    elif status["active"]:
        verdict, code = "affected, fix active", EXIT_OK
    else:
        verdict, code = "affected, fix NOT active", EXIT_AFFECTED
    print("\n".join(lines + [f"verdict: {verdict}"]))
    return code


def _torch_keeps_frozen_tensors() -> Optional[bool]:
    try:
        from zero3_recompute.torch_recompute import recompute_keeps_frozen_tensors

        return recompute_keeps_frozen_tensors()
    except Exception:  # a torch that cannot run the probe: judged by deepspeed's version alone
        return None


def _by_torch(torch_version: str, keeps: Optional[bool]) -> str:
    if keeps is None:
        return f"unknown: torch {torch_version}'s checkpoint could not be probed"
    if keeps:
        return ("affected (its non-reentrant checkpoint keeps the very frozen tensor the recompute saved, "
                "so a release there shrinks it)")
    return ("not affected by the crash (its checkpoint keeps a detached alias of every tensor; stock then "
            "leaves params of modules whose backward never fires gathered until step())")


def _affected(deepspeed_version: str, torch_affected: Optional[bool], report: Optional[dict]) -> bool:
    """The reproduction decides where it ran; else deepspeed's version and torch's checkpoint do."""
    if report is not None:
        return report["stock"]["outcome"] != "ok"
    return versions.classify(versions.parse(deepspeed_version)) == "patch" and torch_affected is not False


def _status_in_process() -> dict:
    import importlib

    from zero3_recompute.reproduce import status_report

    # The start-up hook patches when deepspeed's ZeRO-3 offload module is imported.
    importlib.import_module("deepspeed.runtime.zero.parameter_offload")
    return status_report()
