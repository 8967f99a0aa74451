"""The test matrix as nox sessions, every environment built by uv from one shared cache.

    bash scripts/nox.sh -t fast    the inner loop: the current lines (deepspeed-matrix.txt's
                                   "fast" versions) on the main torch
    bash scripts/nox.sh -t ci      what .ci/run runs: the package check, every deepspeed of the
                                   matrix, the ci torch pairings, transformers 4.57, the report
    bash scripts/nox.sh -t full    everything, the exhaustive cases included; regenerates
                                   docs/support.md and docs/scenarios.md
    bash scripts/nox.sh -s train   the main job (examples/train_llama_lora.py, 2 ranks)

The matrix is data: requirements/torch-matrix.txt (torch, Python, tier, deepspeeds) and
requirements/deepspeed-matrix.txt (the main torch's deepspeeds and their tiers). A cell is one
torch, one deepspeed and one HF stack; it runs in its own tier and every tier above it
(fast < ci < full). What runs in a cell is chosen by pytest markers (NOTE [ Where a test runs ]).

NOTE [ Where a test runs ]
1. A test marked ``once_per_run`` (pure Python, the harness, the repository) runs in one cell of
   the ci and full tiers, the main torch's newest deepspeed (``once_per_run_cell``): the fast
   tier, the inner loop over the current lines, leaves it to them.
2. A test marked ``once_per_torch`` (reads torch, never deepspeed) runs in the first cell of each
   torch.
3. Every other test runs in every cell: it touches deepspeed.
4. A test marked ``exhaustive`` (a case another case already proves, or a wider sweep) runs in
   the full tier only.
5. The two-version lane's tests (tests/unit/lanes.py) run on the current lines in the fast and ci
   tiers (a paired one on each line with one HF stack, a newest_only one on the newest line, an
   hf4_only one there on transformers 4.57 and on every cell with transformers 5), and everywhere
   in the full tier (ZERO3_FULL_LANES=1).

Where pip's configuration names local wheels (find-links), they are named to uv too, which reads
no pip configuration: the main torch is a CPU wheel there.
"""
import configparser
import dataclasses
import os
import pathlib
import shutil
import sys
import time
from typing import Optional

import nox

ROOT = pathlib.Path(__file__).resolve().parent
REQUIREMENTS = ROOT / "requirements"
ENVIRONMENTS = ROOT / ".nox" / "environments"
DEEPSPEED_FOLDERS = ROOT / ".nox" / "deepspeed"
TIERS = ("fast", "ci", "full")
HF_STACKS = ("hf", "hf4")  # requirements/<stack>.txt: transformers 5, transformers 4.57
MAIN_LINE = "main"
FULL_ONLY = "+"

nox.options.sessions = []  # nothing by default: name a tier (-t) or a session (-s)


class MatrixError(ValueError):
    """A line of requirements/ that does not say what noxfile.py expects."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One environment and the deepspeed it runs: a torch on its Python, an HF stack to try
    (``hf4`` on the main torch's second HF pass; elsewhere ``hf``, falling back to ``hf4`` and then
    none where it does not install), and the lowest tier that runs it."""

    python: str
    torch: str
    deepspeed: str
    tier: str
    stack: str = "hf"
    main: bool = False

    @property
    def id(self) -> str:
        return f"torch-{self.torch}-deepspeed-{self.deepspeed}" + ("-hf4" if self.stack == "hf4" else "")

    @property
    def environment(self) -> "Environment":
        """The main torch's cells share one environment per HF stack; another torch's cells take
        the first HF stack that installs there."""
        return Environment(self.python, self.torch, self.stack if self.main else None)

    @property
    def report(self) -> str:
        """The JUnit report's name, as scripts/junit_reports.py reads it."""
        return f"deepspeed-{self.deepspeed}-torch-{self.torch}" + ("-hf4" if self.stack == "hf4" else "") + ".xml"

    def runs_in(self, tier: str) -> bool:
        return TIERS.index(self.tier) <= TIERS.index(tier)


def _tier(word: str, where: str) -> str:
    if word not in TIERS:
        raise MatrixError(f"{where}: expected a tier, one of {', '.join(TIERS)}; got {word!r}")
    return word


def _lines(name: str):
    """(line number, fields) of each line of requirements/<name> with something before its '#'."""
    with open(REQUIREMENTS / name, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            fields = line.partition("#")[0].split()
            if fields:
                yield f"requirements/{name}:{number}", fields


def deepspeed_matrix() -> list:
    """[(version, tier)] of requirements/deepspeed-matrix.txt, in its order."""
    return [(version, tier) for version, tier, _ in _deepspeed_rows()]


def _deepspeed_rows() -> list:
    """[(version, tier, tier of its transformers 4.57 cell)] of requirements/deepspeed-matrix.txt."""
    found = []
    for where, fields in _lines("deepspeed-matrix.txt"):
        if len(fields) != 3:
            raise MatrixError(f"{where}: expected 'VERSION TIER HF4-TIER', got {' '.join(fields)!r}")
        found.append((fields[0], _tier(fields[1], where), _tier(fields[2], where)))
    return found


def main_torch() -> str:
    for where, fields in _lines("torch.txt"):
        if fields[0].startswith("torch=="):
            return fields[0][len("torch=="):]
    raise MatrixError("requirements/torch.txt: expected a line torch==X.Y.Z, found none")


def cells() -> list:
    """Every cell of the matrix: the main torch's first (its deepspeeds, then its transformers 4.57
    pass), then each other torch line's, in the files' order."""
    found = []
    for where, fields in _lines("torch-matrix.txt"):
        if len(fields) < 3 or not fields[0].startswith("torch=="):
            raise MatrixError(f"{where}: expected 'torch==X PYTHON TIER DEEPSPEED...', got {' '.join(fields)!r}")
        torch, python, tier, versions = fields[0][len("torch=="):], fields[1], fields[2], fields[3:]
        if tier == MAIN_LINE:
            if torch != main_torch():
                raise MatrixError(f"{where}: the main line's torch must be requirements/torch.txt's "
                                  f"{main_torch()}, got {torch}")
            rows = _deepspeed_rows()
            found += [Cell(python, torch, version, level, main=True) for version, level, _ in rows]
            found += [Cell(python, torch, version, hf4_level, stack="hf4", main=True) for version, _, hf4_level in rows]
            continue
        tier = _tier(tier, where)
        for version in versions:
            only_full = version.startswith(FULL_ONLY)
            found.append(Cell(python, torch, version.lstrip(FULL_ONLY), "full" if only_full else tier))
    return found


def cells_of(tier: str) -> list:
    return [cell for cell in cells() if cell.runs_in(tier)]


def once_per_run_cell(tier: str) -> Cell:
    """The cell of TIER that runs the ``once_per_run`` tests: the main torch's newest deepspeed with
    the transformers 5 stack. Those tests start many interpreters and ranks, and deepspeed 0.19.8
    imports in 2.7 s here, where 0.14.5-0.19.3 take 8-10 s (they import transformers and torch's
    compiler at their own import)."""
    return [cell for cell in cells_of(tier) if cell.main and cell.stack == "hf"][-1]


def marker_expression(cell: Cell, tier: str) -> str:
    """The pytest -m expression of NOTE [ Where a test runs ] for CELL in TIER."""
    ran = cells_of(tier)
    first_of_torch = next(other for other in ran if other.torch == cell.torch and other.stack == "hf")
    left_out = []
    if tier == "fast" or cell != once_per_run_cell(tier):
        left_out.append("once_per_run")
    if cell != first_of_torch:
        left_out.append("once_per_torch")
    if tier != "full":
        left_out.append("exhaustive")
    expression = " and ".join(f"not {marker}" for marker in left_out)
    if cell.stack == "hf4":
        expression = f"hf and ({expression})" if expression else "hf"
    return expression


def reports_dir(tier: str) -> pathlib.Path:
    """Where a tier's JUnit reports go: ZERO3_REPORTS, else .nox/reports/<tier>."""
    chosen = os.environ.get("ZERO3_REPORTS")
    return pathlib.Path(chosen) if chosen else ROOT / ".nox" / "reports" / tier


def _pip_find_links() -> list:
    """The find-links pip's configuration and environment name (uv reads neither)."""
    parser = configparser.ConfigParser()
    parser.read([os.path.expanduser(path) for path in
                 ("/etc/xdg/pip/pip.conf", "/etc/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf")])
    links = []
    for section in ("global", "install"):
        if parser.has_option(section, "find-links"):
            links += parser.get(section, "find-links").split()
    links += os.environ.get("PIP_FIND_LINKS", "").split()
    return [link for index, link in enumerate(links) if link not in links[:index]]


# Every command a session runs in an environment: bytecode is written on first import, also where
# the caller's environment says PYTHONDONTWRITEBYTECODE (pip compiles at install; uv does not, and
# uncompiled, each rank would compile torch, deepspeed and transformers again: 15 s an import here).
RUN_VARIABLES = {"PYTHONDONTWRITEBYTECODE": ""}


def find_links_options() -> list:
    return [option for link in _pip_find_links() for option in ("--find-links", link)]


def interpreter_for(python: str) -> str:
    """An interpreter of Python X.Y: pyenv's newest X.Y.*, else pythonX.Y on PATH where it runs
    (a pyenv shim of a version not selected does not). uv would otherwise download one."""
    import glob
    import subprocess

    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = sorted(glob.glob(os.path.join(root, "versions", f"{python}.*", "bin", "python")),
                   key=lambda path: [int(part) for part in path.split(os.sep)[-3].split(".") if part.isdigit()])
    candidates = found[-1:] + [path for path in [shutil.which(f"python{python}")] if path]
    for candidate in candidates:
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    raise MatrixError(f"expected Python {python} for requirements/torch-matrix.txt (pyenv install {python}, or "
                      f"python{python} on PATH), found none")


def uv_executable() -> str:
    """The uv nox builds with: the one installed beside nox (scripts/nox.sh), else on PATH."""
    found = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if found is None:
        raise RuntimeError("expected uv beside nox or on PATH (bash scripts/nox.sh installs both), found none")
    return found


@dataclasses.dataclass(frozen=True)
class Environment:
    """A venv one torch line shares between its deepspeeds (each a --target folder on PYTHONPATH,
    deepspeed_folder): torch first, held at its release for every later install, the runtime and
    test tools, an HF stack (``stack``, or the first of HF_STACKS that installs beside that torch
    and Python where it is None), the checkout in editable mode. Built with uv from its one cache
    (hardlinked into each venv), and again only when what it is built from changes. uv compiles
    no bytecode: the first import of a module writes it (RUN_VARIABLES), only for what is imported."""

    python: str
    torch: str
    stack: Optional[str]

    @property
    def path(self) -> pathlib.Path:
        return ENVIRONMENTS / (f"torch-{self.torch}" + (f"-{self.stack}" if self.stack else ""))

    @property
    def interpreter(self) -> str:
        return str(self.path / "bin" / "python")

    def _fingerprint(self) -> str:
        import hashlib

        stacks = (self.stack,) if self.stack else HF_STACKS
        files = [REQUIREMENTS / name for name in ("runtime.txt", "test.txt", "nox.txt")]
        files += [REQUIREMENTS / f"{stack}.txt" for stack in stacks] + [ROOT / "pyproject.toml"]
        inputs = [f"{self.python} {self.torch} {self.stack} {sorted(_pip_find_links())}"]
        inputs += [path.read_text() for path in files]
        return hashlib.sha256("\n".join(inputs).encode()).hexdigest()

    def hf_stack(self) -> str:
        """What the support table says of its HF stack: 'transformers X', or why neither installs."""
        return (self.path / "hf-stack").read_text().strip()

    def ensure(self, session: nox.Session) -> None:
        marker, fingerprint = self.path / "complete", self._fingerprint()
        if marker.exists() and marker.read_text() == fingerprint:
            return
        started = time.monotonic()
        shutil.rmtree(self.path, ignore_errors=True)
        uv = uv_executable()
        try:
            python = interpreter_for(self.python)
        except MatrixError as missing:
            session.error(str(missing))
        session.run(uv, "venv", "-q", "--python", python, str(self.path), external=True,
                    env={"UV_PYTHON_DOWNLOADS": "never"})
        pin = self.path / "torch-pin.txt"
        pin.write_text(f"torch=={self.torch}\n")
        install = [uv, "pip", "install", "-q", "--python", self.interpreter,
                   *find_links_options()]
        session.run(*install, f"torch=={self.torch}", external=True)
        session.run(*install, "-c", str(pin), "-r", "requirements/runtime.txt", "-r", "requirements/test.txt",
                    external=True)
        said = self._install_hf_stack(session, [*install, "-c", str(pin)])
        session.run(*install, "--no-deps", "-e", ".", external=True)
        (self.path / "hf-stack").write_text(said + "\n")
        marker.write_text(fingerprint)
        session.log(f"{self.path.name}: built in {time.monotonic() - started:.0f} s ({said})")

    def _install_hf_stack(self, session: nox.Session, install: list) -> str:
        """The first HF stack that resolves beside this torch and Python; 'transformers X', or why
        neither resolves. A fixed stack that fails, or a failure other than resolution (the
        network), ends the session, and the environment is not marked complete."""
        import subprocess

        unresolved = []
        for stack in (self.stack,) if self.stack else HF_STACKS:
            session.log(" ".join([*install, "-r", f"requirements/{stack}.txt"]))
            done = subprocess.run([*install, "-r", f"requirements/{stack}.txt"], cwd=ROOT, capture_output=True, text=True)
            if done.returncode == 0:
                version = session.run(self.interpreter, "-c", "import transformers; print(transformers.__version__)",
                                      env=RUN_VARIABLES, external=True, silent=True)
                return f"transformers {version.strip().splitlines()[-1]}"
            lines = [line.strip(" ×╰─▶") for line in done.stderr.splitlines() if line.strip(" ×╰─▶")]
            if self.stack or not any("No solution found" in line for line in lines):
                session.error(f"requirements/{stack}.txt did not install beside torch {self.torch}:\n{done.stderr}")
            unresolved.append(f"{stack}.txt: {' '.join(lines[1:3])}")
        return f"neither HF stack installs beside torch {self.torch} on Python {self.python}: {'; '.join(unresolved)}"


def deepspeed_folder(session: nox.Session, environment: Environment, version: str) -> str:
    """deepspeed VERSION without its dependencies (the runtime's deepspeed brought them) in a
    folder of its own for the environment's Python: put on PYTHONPATH, it stands in for
    the environment's deepspeed."""
    folder = DEEPSPEED_FOLDERS / f"{version}-py{environment.python}"
    if not (folder / "complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        session.run(uv_executable(), "pip", "install", "-q", "--python", environment.interpreter,
                    *find_links_options(), "--no-deps", "--target", str(folder), f"deepspeed=={version}",
                    external=True)
        (folder / "complete").write_text(version)
    return str(folder)


def extensions_dir(torch: str, deepspeed: str) -> str:
    """deepspeed JIT-builds its CPU comm op: one folder per torch and deepspeed, under
    TORCH_EXTENSIONS_DIR where it is set."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    return os.path.join(base, f"torch-{torch}-deepspeed-{deepspeed}")


def deepspeed_variables(session: nox.Session, environment: Environment, version: str) -> dict:
    """What a command in ENVIRONMENT runs under with deepspeed VERSION: RUN_VARIABLES, that
    deepspeed's folder on PYTHONPATH, the extensions folder of its torch and deepspeed."""
    return {**RUN_VARIABLES, "PYTHONPATH": deepspeed_folder(session, environment, version),
            "TORCH_EXTENSIONS_DIR": extensions_dir(environment.torch, version)}


def run_cell(session: nox.Session, cell: Cell, tier: str) -> None:
    started = time.monotonic()
    reports = reports_dir(tier)
    reports.mkdir(parents=True, exist_ok=True)
    report = reports / cell.report
    report.unlink(missing_ok=True)
    environment = cell.environment
    environment.ensure(session)
    variables = deepspeed_variables(session, environment, cell.deepspeed)
    if not cell.main:
        (reports / f"torch-{cell.torch}.hf").write_text(environment.hf_stack() + "\n")
    session.log(f"{cell.id}: {environment.hf_stack()}, set up in {time.monotonic() - started:.0f} s")
    if tier == "full":
        variables["ZERO3_FULL_LANES"] = "1"
    # Paths among the arguments (a file, a node id) replace the cell's own.
    named = [arg for arg in session.posargs if "::" in arg or arg.endswith(".py")
             or (arg.startswith("tests") and os.path.isdir(arg))]
    paths = [] if named else ["tests/integration"] if cell.stack == "hf4" else ["tests"]
    expression = marker_expression(cell, tier)
    selection = ["-m", expression] if expression else []
    session.run(environment.interpreter, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                f"--junitxml={report}", *paths, *selection, *session.posargs, env=variables, external=True)
    session.log(f"{cell.id}: {time.monotonic() - started:.0f} s in all")


def _tier_session(tier: str):
    """The session of one tier, parametrized over the cells that run in it."""

    @nox.session(name=tier, python=False, tags=[tier])
    @nox.parametrize("cell", [nox.param(cell, id=cell.id) for cell in cells_of(tier)])
    def tier_session(session: nox.Session, cell: Cell) -> None:
        run_cell(session, cell, tier)

    tier_session.__doc__ = f"The {tier} tier's cells (NOTE [ Where a test runs ])."
    return tier_session


fast = _tier_session("fast")
ci = _tier_session("ci")
full = _tier_session("full")


@nox.session(python=False, tags=["full"])
def upstream(session: nox.Session) -> None:
    """ZERO3_RECOMPUTE_POLICY=upstream on the newest deepspeed of the matrix, main torch: the
    branches of tests/unit/v1/zero that only deepspeed's own handling, left in charge, takes (its
    known failures xfail). In the full tier; its report is ...-upstream.xml."""
    newest_line = deepspeed_matrix()[-1][0]
    cell = next(cell for cell in cells() if cell.main and cell.stack == "hf" and cell.deepspeed == newest_line)
    environment = cell.environment
    environment.ensure(session)
    reports = reports_dir("full")
    reports.mkdir(parents=True, exist_ok=True)
    variables = {**deepspeed_variables(session, environment, cell.deepspeed),
                 "ZERO3_RECOMPUTE_POLICY": "upstream", "ZERO3_FULL_LANES": "1"}
    report = reports / cell.report.replace(".xml", "-upstream.xml")
    session.run(environment.interpreter, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={report}",
                "tests/unit/v1/zero", "-m", "not exhaustive", *session.posargs, env=variables, external=True)


def main_environment() -> Environment:
    """The main torch's environment with the transformers 5 stack: the main job's, the package
    check's and the report's."""
    return next(cell.environment for cell in cells() if cell.main and cell.stack == "hf")


@nox.session(python=False, tags=["ci", "full"])
def package(session: nox.Session) -> None:
    """The package as others ship it (scripts/check_package.sh): sdist, wheel, twine, a fresh venv."""
    environment = main_environment()
    environment.ensure(session)
    session.run("bash", "scripts/check_package.sh", external=True,
                env={**RUN_VARIABLES, "BUILD_PYTHON": environment.interpreter, "UV": uv_executable(),
                     "FIND_LINKS": " ".join(_pip_find_links()),
                     "PYTHON": interpreter_for(environment.python)})


@nox.session(python=False)
def train(session: nox.Session) -> None:
    """The main job: PEFT LoRA fine-tuning of a small Llama under ZeRO-3 with non-reentrant
    checkpointing, through the deepspeed launcher (scripts/train.sh; README "The two commands").
    DS_VERSION picks a deepspeed of the matrix (default: requirements/runtime.txt's), NUM_GPUS the
    ranks (default 2; gloo ranks on a CPU-only machine), EXAMPLE another script of examples/;
    arguments after -- go to the script."""
    started = time.monotonic()
    version = os.environ.get("DS_VERSION")
    known = [known for known, _ in deepspeed_matrix()]
    if version and version not in known:
        session.error(f"DS_VERSION: expected a deepspeed of requirements/deepspeed-matrix.txt ({', '.join(known)}), "
                      f"got {version}")
    environment = main_environment()
    environment.ensure(session)
    variables = dict(RUN_VARIABLES)
    if version:
        variables["PYTHONPATH"] = deepspeed_folder(session, environment, version)
    installed = session.run(environment.interpreter, "-c", "import deepspeed; print(deepspeed.__version__)",
                            env=variables, external=True, silent=True).strip().splitlines()[-1]
    session.log(f"set up in {time.monotonic() - started:.0f} s: torch {environment.torch}, deepspeed {installed}")
    ranks = os.environ.get("NUM_GPUS", "2")
    variables.update({
        # deepspeed's CPU accelerator counts its devices from LOCAL_SIZE, or else runs numactl
        # (0.14.x's launcher needs one or the other); CUDA ignores it.
        "LOCAL_SIZE": os.environ.get("LOCAL_SIZE", ranks),
        "TORCH_EXTENSIONS_DIR": extensions_dir(environment.torch, installed),
        "PATH": f"{environment.path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    })
    session.run(str(environment.path / "bin" / "deepspeed"), "--num_gpus", ranks,
                os.environ.get("EXAMPLE", "examples/train_llama_lora.py"), *session.posargs, env=variables,
                external=True)


def newest_on_index(name: str) -> str:
    """The newest release of NAME on the package index (pip index versions)."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(f"{name} ("):
            return line[len(name) + 2:].rstrip(")")
    raise RuntimeError(f"could not resolve the newest {name} on the package index: {done.stderr.strip()}")


@nox.session(python=False)
@nox.parametrize("torch_line", [nox.param("main", id="main-torch"), nox.param("newest", id="newest-torch")])
def newest(session: nox.Session, torch_line: str) -> None:
    """Does the package still fit the newest deepspeed on the index, on the main torch and on the
    newest torch? The core set and the scenario matrix, and one line: "classification for ...:
    patched and passing | patched, N failing | refused: <the named mismatch> | ...". Needs the
    package index, so it is in no tier (.github/workflows/newest-deepspeed.yml runs it weekly).
    DS_NEWEST=0.19.8 and TORCH_NEWEST=2.15.0 skip the look-ups; the newest torch runs on Python
    TORCH_NEWEST_PYTHON (default 3.12)."""
    version = os.environ.get("DS_NEWEST") or newest_on_index("deepspeed")
    if torch_line == "main":
        environment = main_environment()
    else:
        environment = Environment(os.environ.get("TORCH_NEWEST_PYTHON", "3.12"),
                                  os.environ.get("TORCH_NEWEST") or newest_on_index("torch"), None)
    label = f"deepspeed {version}, torch {environment.torch}"
    session.log(f"newest on the index: {label}")
    environment.ensure(session)
    variables = deepspeed_variables(session, environment, version)
    found = session.run(environment.interpreter, "scripts/classify_release.py", "status", env=variables,
                        external=True, silent=True)
    report = pathlib.Path(session.create_tmp()) / "newest.xml"
    session.run(environment.interpreter, "-m", "pytest", "tests/unit/v1/zero", "-q", "-rs", "-p", "no:cacheprovider",
                "-k", "FrozenParamCheckpointing or RecomputeScenarios", f"--junitxml={report}", env=variables,
                external=True, success_codes=[0, 1])
    # deepspeed prints its accelerator warning too: only the status line counts.
    status = next((line for line in found.splitlines() if line.startswith("status|")), "status|unknown|-|no status")
    verdict = session.run(environment.interpreter, "scripts/classify_release.py", "verdict", status, str(report),
                          external=True, silent=True)
    verdict = verdict.strip().splitlines()[-1]
    print(f"classification for {label}: {verdict}")
    import xml.etree.ElementTree as ElementTree

    suites = list(ElementTree.parse(report).getroot().iter("testsuite"))
    if sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites):
        session.error(verdict)


@nox.session(python=False)
@nox.parametrize("tier", [nox.param(tier, id=tier, tags=[tier]) for tier in TIERS])
def report(session: nox.Session, tier: str) -> None:
    """One closing line over the tier's reports, and the support and scenario tables (the full
    tier's regenerate docs/support.md and docs/scenarios.md). Fails where a cell left no report."""
    environment = main_environment()
    environment.ensure(session)
    python = environment.interpreter
    reports = reports_dir(tier)
    expected = [reports / cell.report for cell in cells_of(tier)]
    missing = [path.name for path in expected if not path.exists()]
    session.run(python, "scripts/summarize_junit.py", str(reports), external=True)
    if missing:
        session.error(f"expected a report from each of the {tier} tier's {len(expected)} cells in {reports}; "
                      f"missing {', '.join(missing)} (no table is written)")
    session.run(python, "scripts/scenario_table.py", str(reports), str(reports / "scenarios.md"), external=True)
    session.run(python, "scripts/support_table.py", str(reports), str(reports / "support.md"), external=True)
    if tier == "full":
        session.run(python, "scripts/support_table.py", str(reports), "--readme", "docs/support.md", external=True)
        shutil.copyfile(reports / "scenarios.md", ROOT / "docs" / "scenarios.md")
        session.log("docs/support.md and docs/scenarios.md regenerated")
