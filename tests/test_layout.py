"""The package's layers: decoding loops reach a model only through the decoding-model interface."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "jaxdecode"

# modules that run a decoding algorithm: they may import jaxdecode.models.base, never the Flax
# model, the native layer or Flax itself
LOOPS = ["core.py", "sampling.py", "beam.py", "search.py", "contrastive.py", "score.py", "speculative/loop.py", "speculative/acceptance.py"]
FORBIDDEN = {"jaxdecode.model", "jaxdecode.kernels", "jaxdecode.models.charlm", "flax"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against its package."""
    package = ["jaxdecode", *path.relative_to(PKG).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("name", LOOPS)
def test_loops_use_only_the_model_interface(name):
    path = PKG / name
    assert path.is_file(), name
    bad = {m for m in _imports(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}
    assert not bad, f"{name} imports {sorted(bad)}"


def test_no_module_is_overly_long():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 650}
    assert not long, long
