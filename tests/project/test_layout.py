"""The package's layers: a folder per layer, each importing only the layers below it, no import
cycle, and short modules."""

import ast
from pathlib import Path

import pytest


PKG = Path(__file__).resolve().parents[2] / "jaxdecode"

# What each folder may import besides itself (a name covers its submodules). ``models.base`` is
# the decoding-model interface; the loops reach a model only through it.
INTERFACE = {"models.base", "models.lm", "models.checkpoint"}
ALLOWED = {
    "io": set(),
    "native": {"io"},
    "rules": {"io"},
    "constraints": {"io"},
    "models": {"io", "native", "rules"},
    "decoding": {"io", "rules", "constraints", "models.base"},
    "speculative": {"io", "rules", "constraints", "decoding"} | INTERFACE,
    "serving": {"io", "rules", "constraints", "decoding", "speculative", "models.base"},
    "server": {"io", "rules", "constraints", "decoding", "serving"} | INTERFACE,
    "eval": {"io", "native", "rules", "constraints", "models", "decoding", "speculative", "serving"},
    "cli": {"io", "native", "rules", "constraints", "models", "decoding", "speculative", "serving", "server", "eval"},
    "": {"io", "rules", "models", "decoding"},  # jaxdecode/__init__.py: the flat API
}
# names a layer must not mention at all, even in a lazy import
CONCRETE = ("models.charlm", "models.hf", "models.toy", "native")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The jaxdecode modules ``path`` imports (relative to the package, "" for the package itself),
    at any depth in the file; ``from a import b`` counts as importing ``a.b`` when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s.removeprefix("jaxdecode.") in MODULES] or [node.module]
        else:
            continue
        for n in names:
            if n == "jaxdecode":
                found.add("")
            elif n.startswith("jaxdecode."):
                n = n.removeprefix("jaxdecode.")
                while n and n not in MODULES:
                    n = n.rpartition(".")[0]
                found.add(n)
    return found - {_module(path)}


def _layer(module: str) -> str:
    return module.split(".")[0] if module else ""


def _covers(allowed: set[str], module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


@pytest.mark.quick
@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_only_the_layers_below(module):
    layer = _layer(module)
    assert layer in ALLOWED, f"{module}: the folder {layer!r} has no rule in tests/project/test_layout.py"
    bad = {m for m in GRAPH[module] if _layer(m) != layer and not _covers(ALLOWED[layer], m)}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.quick
@pytest.mark.parametrize("layer", ["decoding", "speculative", "serving"])
def test_loops_never_name_a_concrete_model(layer):
    for module, path in MODULES.items():
        if _layer(module) == layer:
            named = [m for m in GRAPH[module] if _covers(set(CONCRETE), m)]
            named += ["CharLM"] if "CharLM" in path.read_text() else []
            assert not named, f"{module} names {named}"


@pytest.mark.quick
def test_no_import_cycle():
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for n in GRAPH[m]:
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(c or "jaxdecode" for c in cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


@pytest.mark.quick
def test_folders_and_short_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 6, top
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


@pytest.mark.quick
def test_the_registries_are_one_type_and_take_a_users_entry():
    """Rules, drafts and studies are each a Registry of frozen specs; a draft of one's own is
    registered with the public decorator, built by name, and a taken name is refused."""
    from jaxdecode.eval.studies import STUDIES
    from jaxdecode.io.registry import Registry
    from jaxdecode.rules import RULES
    from jaxdecode.speculative import DRAFTS, make_draft, register_draft

    assert all(isinstance(r, Registry) for r in (RULES, DRAFTS, STUDIES))
    with pytest.raises(ValueError, match="a draft kind named 'ngram' is already registered"):
        register_draft("ngram", "again")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="unknown decoding setting 'top_q': use 'repetition_penalty', "):
        RULES.lookup("top_q")
    calls = []
    builder = register_draft("mine", "a draft of the user's own")(lambda lm, data_path=None, **kw: calls.append((lm, kw)))
    try:
        assert DRAFTS["mine"].about == "a draft of the user's own" and DRAFTS["mine"].builder is builder
        assert list(DRAFTS)[-1] == "mine"
        make_draft("mine", "LM", n=2)
        assert calls == [("LM", {"n": 2, "backoff": None, "progress": False})]
    finally:
        del DRAFTS["mine"]


def _config_reads(tree) -> list[str]:
    """Reads of a model's attention head count from its config: ``getattr(<...cfg...>, "heads"...)``
    and ``<...>.cfg.heads``."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "heads" and "cfg" in ast.unparse(node.args[0])):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Attribute) and node.attr == "heads"
              and isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


# the CLI's `info` prints a checkpoint's shape, heads included
READS_CONFIG = {"cli"}


@pytest.mark.quick
def test_only_models_read_a_models_config():
    """Outside models/, a loop asks the model (``attention_heads``) instead of reading its config."""
    bad = {}
    for module, path in MODULES.items():
        if _layer(module) not in {"models"} | READS_CONFIG:
            if found := _config_reads(ast.parse(path.read_text())):
                bad[module] = found
    assert not bad, bad
    probe = 'h = getattr(getattr(model, "cfg", None), "heads", 1)\nk = lm.cfg.heads'
    caught = _config_reads(ast.parse(probe))
    assert len(caught) == 2, caught


def _private_uses(module: str, tree) -> list[str]:
    """The underscore names ``module`` takes from a module of another layer: imported by name, or
    read as an attribute of an imported module."""
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxdecode"):
            source = node.module.removeprefix("jaxdecode").removeprefix(".")
            for a in node.names:
                full = f"{source}.{a.name}".removeprefix(".")
                if full in MODULES:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and _layer(source) != _layer(module):
                    found.append(f"{source}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jaxdecode.") and a.asname:
                    aliases[a.asname] = a.name.removeprefix("jaxdecode.")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and _layer(aliases[node.value.id]) != _layer(module)):
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


@pytest.mark.quick
def test_no_private_name_crosses_a_layer():
    """A layer uses another layer's public names only (inside a layer, modules share helpers)."""
    bad = {m: used for m, p in MODULES.items() if (used := _private_uses(m, ast.parse(p.read_text())))}
    assert not bad, bad
    probe = "from jaxdecode.decoding.steps import _prefill\nfrom jaxdecode.native import kernels\nkernels._x(1)"
    caught = _private_uses("eval.studies.cost", ast.parse(probe))
    assert caught == ["decoding.steps._prefill", "native.kernels._x"]
    same_layer = "from jaxdecode.decoding.steps import _prefill"
    assert _private_uses("decoding.sampling", ast.parse(same_layer)) == []


# ----------------------------------------------------------------------------- the library's habits


def _private_imports(module: str, tree) -> list[str]:
    """The single-underscore names ``module`` imports by name from another module of the package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxdecode"):
            source = node.module.removeprefix("jaxdecode").removeprefix(".")
            found += [f"{source}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__") and source != module]
    return found


MAX_PRIVATE_IMPORTS = 10


@pytest.mark.quick
def test_few_private_names_cross_modules():
    """A helper that another module needs is public (a docstring line, no underscore) or lives
    where it is used: at most a few underscore names are imported across modules."""
    used = {m: found for m, p in MODULES.items() if (found := _private_imports(m, ast.parse(p.read_text())))}
    count = sum(len(v) for v in used.values())
    assert count <= MAX_PRIVATE_IMPORTS, (count, used)
    probe = "from jaxdecode.decoding.steps import _prefill, grow\nfrom jaxdecode.rules.base import __all__, _col"
    assert _private_imports("decoding.sampling", ast.parse(probe)) == ["decoding.steps._prefill", "rules.base._col"]
    assert _private_imports("decoding.steps", ast.parse("from jaxdecode.decoding.steps import _prefill")) == []


# The modules that export the decoding loops: every function they export from decoding/ or
# speculative/ takes a request's settings as one DecodeParams (``params``, keywords overriding it)
# and at most this many other parameters.
LOOP_MODULES = ("jaxdecode", "jaxdecode.decoding.sampling", "jaxdecode.speculative")
MAX_OTHER_PARAMETERS = 6


def _other_parameters(fn) -> list[str]:
    import inspect

    return [name for name, p in inspect.signature(fn).parameters.items()
            if name != "params" and p.kind is not inspect.Parameter.VAR_KEYWORD]


@pytest.mark.quick
def test_public_decoding_functions_take_few_parameters():
    import importlib
    import inspect

    over = {}
    for name in LOOP_MODULES:
        module = importlib.import_module(name)
        for export in module.__all__:
            fn = getattr(module, export)
            if inspect.isfunction(fn) and fn.__module__.startswith(("jaxdecode.decoding", "jaxdecode.speculative")):
                if len(others := _other_parameters(fn)) > MAX_OTHER_PARAMETERS:
                    over[f"{name}.{export}"] = others
    assert not over, over

    def wide(model, params, prompts, a, b, c, d, e, *, f=None, **overrides):
        pass

    def narrow(lm, prompts, params=None, *, key=None, on_text=None, progress=False, mesh=None, **overrides):
        pass

    assert len(_other_parameters(wide)) == 8 and len(_other_parameters(narrow)) == 6


MAX_DOCSTRING_LINES = 25
# modules whose docstring may be longer, each with its reason (none: derivations live in docs/)
LONG_DOCSTRINGS: dict[str, str] = {}


def _docstring_lines(tree) -> int:
    doc = ast.get_docstring(tree, clean=False)
    return len(doc.splitlines()) if doc else 0


@pytest.mark.quick
def test_module_docstrings_say_what_and_why_briefly():
    """A module's docstring says what it does and why in about 20 lines; derivations, tables and
    measurements go to the matching page of docs/, which the docstring names."""
    long = {m: n for m, p in MODULES.items()
            if (n := _docstring_lines(ast.parse(p.read_text()))) > MAX_DOCSTRING_LINES and m not in LONG_DOCSTRINGS}
    assert not long, long
    assert set(LONG_DOCSTRINGS) <= set(MODULES), "an exception names a module that is gone"
    assert _docstring_lines(ast.parse('"""one\n\ntwo\nthree"""\nx = 1')) == 4
