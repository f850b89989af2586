"""The quick subset (``python -m pytest -n auto -m quick``, tests/conftest.py's ``QUICK``) stays what
docs/testing.md says it is: a few tests of every test file, each one a test that exists.

Read from the files' source (no import, no collection), so that it costs nothing."""

import ast
from pathlib import Path

from conftest import QUICK, UNMATCHED_QUICK

TESTS = Path(__file__).resolve().parent


def _tests_of(path: Path) -> tuple[set[str], set[str], bool]:
    """The test functions of a file, those of them marked ``quick`` in the file, and whether the
    whole file is (``pytestmark``)."""
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


def test_every_quick_name_is_a_test_of_its_file():
    """A renamed or removed test would otherwise leave the quick subset silently smaller."""
    missing = []
    for file, entries in QUICK.items():
        path = TESTS / file
        names = _tests_of(path)[0] if path.is_file() else set()
        missing += [f"{file}::{e}" for e in entries if e.split("[")[0] not in names]
    assert not missing, f"named in tests/conftest.py's QUICK but not a test of that file: {missing}"


def test_every_quick_name_selects_a_test():
    """A name with its parametrization's ids (``name[ids]``) selects that test of this collection:
    renamed ids would otherwise drop it silently (tests/conftest.py fills the list)."""
    assert not UNMATCHED_QUICK, f"named in tests/conftest.py's QUICK but selecting no test: {UNMATCHED_QUICK}"


def test_every_test_file_has_a_quick_test():
    """A new test file joins the quick subset with a test or two: name them in tests/conftest.py's
    QUICK, or mark them ``@pytest.mark.quick`` (a few that run in seconds; docs/testing.md)."""
    lacking = []
    for path in sorted(TESTS.glob("test_*.py")):
        names, marked, whole = _tests_of(path)
        if names and not (whole or marked or QUICK.get(path.name)):
            lacking.append(path.name)
    assert not lacking, (f"test files with no test in the quick subset: {lacking}; name a few of their "
                         f"fast tests in tests/conftest.py's QUICK or mark them @pytest.mark.quick")
