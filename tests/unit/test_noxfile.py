"""noxfile.py's matrix: the cells each tier runs, read from requirements/, and NOTE [ Where a test
runs ]'s pytest selection of each cell; a line that does not say what the noxfile expects is
refused, expected vs got."""
import importlib.util
import os

import pytest

pytestmark = pytest.mark.once_per_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def noxfile():
    spec = importlib.util.spec_from_file_location("noxfile_under_test", os.path.join(ROOT, "noxfile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ids(cells) -> list:
    return [cell.id for cell in cells]


def test_each_tier_runs_its_cells_and_every_cell_of_the_tiers_below(noxfile):
    matrix = noxfile.deepspeed_matrix()
    main = noxfile.main_torch()
    fast = noxfile.cells_of("fast")
    assert _ids(fast) == [f"torch-{main}-deepspeed-{version}" for version, tier in matrix if tier == "fast"]
    ci = noxfile.cells_of("ci")
    assert set(_ids(fast)) < set(_ids(ci)) < set(_ids(noxfile.cells_of("full")))
    # ci: every deepspeed on the main torch, transformers 4.57 with the current lines, a pairing per ci torch line.
    assert {f"torch-{main}-deepspeed-{version}" for version, _ in matrix} <= set(_ids(ci))
    assert [cell.id for cell in ci if cell.stack == "hf4"] == [f"torch-{main}-deepspeed-0.19.2-hf4"]
    assert sorted({cell.torch for cell in ci if not cell.main}) == ["2.10.0", "2.14.1", "2.5.1"]
    assert all(cell.runs_in("full") for cell in noxfile.cells())


def test_each_cell_selects_by_the_notes_rules(noxfile):
    ci = noxfile.cells_of("ci")
    lead, second = ci[0], ci[1]
    newest = noxfile.once_per_run_cell("ci")
    assert (newest.torch, newest.deepspeed, newest.stack) == ("2.13.0", "0.19.8", "hf")
    assert noxfile.marker_expression(lead, "ci") == "not once_per_run and not exhaustive"
    assert noxfile.marker_expression(second, "ci") == "not once_per_run and not once_per_torch and not exhaustive"
    assert noxfile.marker_expression(newest, "ci") == "not once_per_torch and not exhaustive"
    first_pairing = next(cell for cell in ci if not cell.main)
    assert noxfile.marker_expression(first_pairing, "ci") == "not once_per_run and not exhaustive"
    hf4 = next(cell for cell in ci if cell.stack == "hf4")
    assert noxfile.marker_expression(hf4, "ci") == "hf and (not once_per_run and not once_per_torch and not exhaustive)"
    fast = noxfile.cells_of("fast")
    assert noxfile.marker_expression(fast[0], "fast") == "not once_per_run and not exhaustive"
    full = noxfile.cells_of("full")
    assert noxfile.marker_expression(full[0], "full") == "not once_per_run"
    assert noxfile.marker_expression(full[1], "full") == "not once_per_run and not once_per_torch"
    assert noxfile.marker_expression(noxfile.once_per_run_cell("full"), "full") == "not once_per_torch"


def test_the_main_torch_shares_one_environment_per_stack_and_a_pairing_picks_its_own(noxfile):
    main = [cell for cell in noxfile.cells() if cell.main]
    assert {cell.environment.path.name for cell in main} == {f"torch-{noxfile.main_torch()}-hf",
                                                            f"torch-{noxfile.main_torch()}-hf4"}
    pairing = next(cell for cell in noxfile.cells() if not cell.main)
    assert pairing.environment.stack is None and pairing.environment.path.name == f"torch-{pairing.torch}"


@pytest.mark.parametrize("line, said", [
    ("0.19.2  fastest  ci", "expected a tier, one of fast, ci, full; got 'fastest'"),
    ("0.19.2  fast", "expected 'VERSION TIER HF4-TIER', got '0.19.2 fast'"),
])
def test_a_line_that_does_not_say_what_is_expected_is_refused(noxfile, tmp_path, monkeypatch, line, said):
    for name in ("torch.txt", "torch-matrix.txt"):
        (tmp_path / name).write_text(open(os.path.join(ROOT, "requirements", name)).read())
    (tmp_path / "deepspeed-matrix.txt").write_text(f"# a comment\n{line}  # 0.19.0 - 0.19.2\n")
    monkeypatch.setattr(noxfile, "REQUIREMENTS", tmp_path)
    with pytest.raises(noxfile.MatrixError, match="requirements/deepspeed-matrix.txt:2: " + said.replace("(", r"\(")
                       .replace(")", r"\)")):
        noxfile.cells()


def test_each_python_of_the_matrix_is_found_and_a_missing_one_is_refused(noxfile):
    """uv would download a Python it cannot find (no network here): the noxfile finds pyenv's or
    PATH's itself, or says which is missing."""
    import subprocess

    for python in sorted({cell.python for cell in noxfile.cells()}):
        found = noxfile.interpreter_for(python)
        done = subprocess.run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                              text=True)
        assert done.stdout.strip() == python, f"{found} is Python {done.stdout.strip()}, expected {python}"
    with pytest.raises(noxfile.MatrixError, match=r"expected Python 3\.99 .*found none"):
        noxfile.interpreter_for("3.99")
