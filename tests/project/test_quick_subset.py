"""The quick subset (``python -m pytest -n auto -m quick``: tests marked ``quick``, or ``quick_ids``
for some of their parametrizations; tests/conftest.py) stays what docs/testing.md says it is: a few
tests of every test file, each id named selecting a test.

Read from the files' source where it can be (no import, no collection), so that it costs nothing."""

import ast
from pathlib import Path

import pytest

from conftest import UNMATCHED_QUICK

TESTS = Path(__file__).resolve().parents[1]


def _quick_tests(path: Path) -> tuple[set[str], set[str], bool]:
    """The test functions of a file, those of them marked ``quick`` or ``quick_ids`` in the file, and
    whether the whole file is (``pytestmark``)."""
    tree = ast.parse(path.read_text())
    names, marked, whole = set(), set(), False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
            if any("mark.quick" in ast.unparse(d) for d in node.decorator_list):
                marked.add(node.name)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark"
                                                  for t in node.targets):
            whole |= "mark.quick" in ast.unparse(node.value)
    return names, marked, whole


@pytest.mark.quick
def test_every_quick_id_selects_a_test():
    """``quick_ids`` names parametrizations by their ids: renamed ids would otherwise drop them from
    the subset silently (tests/conftest.py fills the list when whole files are collected)."""
    assert not UNMATCHED_QUICK, f"quick_ids naming no parametrization of their test: {UNMATCHED_QUICK}"


@pytest.mark.quick
def test_every_test_file_has_a_quick_test():
    """A new test file joins the quick subset with a test or two, marked ``@pytest.mark.quick`` (a
    few that run in seconds; docs/testing.md)."""
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50
    lacking = []
    for path in files:
        names, marked, whole = _quick_tests(path)
        if names and not (whole or marked):
            lacking.append(str(path.relative_to(TESTS)))
    assert not lacking, f"test files with no quick test: {lacking}; mark a few fast tests @pytest.mark.quick"


@pytest.mark.quick
def test_tests_mirror_the_package():
    """Tests live in a folder named after the package's folder they test (tests/decoding/ for
    jaxdecode/decoding/, ...), project-wide checks in tests/project/, helpers in tests/support/; no
    test file at the top, and no two test files of one name (they are imported by their name)."""
    package = TESTS.parent / "jaxdecode"
    folders = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    files = list(TESTS.rglob("test_*.py"))
    assert not [p.name for p in files if p.parent == TESTS], "test files at the top of tests/"
    stray = sorted({p.parent.name for p in files} - folders - {"project"})
    assert not stray, f"test folders that name no folder of the package: {stray}"
    names = [p.name for p in files]
    assert len(names) == len(set(names)), "two test files of one name"
