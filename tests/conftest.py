import collections
import contextlib
import json
import os
from pathlib import Path

import jax
import pytest
from hypothesis import settings

# The native CPU layer is required in the tests: a failed build fails them instead of silently
# testing the portable path twice. Loop tests run on both backends (the `backend` fixture).
os.environ.setdefault("JAXDECODE_KERNELS", "1")
# The tests download nothing: a test that would fetch the corpus fails with the corpus error instead.
os.environ["JAXDECODE_OFFLINE"] = "1"
jax.config.update("jax_numpy_rank_promotion", "raise")

# The suite's time goes to XLA's compiler, not to running programs: measured over a full run at XLA's
# defaults, each worker spent about 1,040 of its 1,620 seconds in the CPU backend's compiles (and 300
# more tracing and lowering). The tests check what programs compute, not how fast, so they compile
# with LLVM's optimization turned down and XLA's older CPU code generator for fusions (the newer
# fusion emitters take twice as long to compile): 12 min 50 s in all against 27 min
# (docs/testing.md). The library itself compiles at XLA's defaults. $XLA_FLAGS, if set, wins.
# (LLVM's optimization is turned down through JAX's own switch, jax_disable_most_optimizations, so
# that a test marked `optimized` can turn it back up: see _optimized below. Turned back up, it runs
# at XLA's backend optimization level 1, not the default 3: the programs run as fast and compile in
# two thirds of the time; the speculative exactness draws went from 114 s to 85 s on two workers.)
OWN_XLA_FLAGS = "XLA_FLAGS" not in os.environ
if OWN_XLA_FLAGS:
    os.environ["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # for the processes the tests start
    jax.config.update("jax_disable_most_optimizations", True)

# One compilation cache on disk, shared by the xdist workers and kept between runs: a program that
# several tests, both workers or an earlier run built is loaded instead of compiled. Programs are
# keyed by their HLO, the compiler options and the jax version, so a hit is the same program. By
# default it lives in the checkout's own .pytest_cache (a clean clone, as .ci/run's, starts with an
# empty one); $JAXDECODE_TEST_JAX_CACHE names another folder. Measured (docs/testing.md): within
# one cold run it saves about what it costs (3% of CPU writing entries); a second run of the quick
# subset takes 37% less CPU with it warm. Past CACHE_KEEP_BYTES the least recently written entries
# go, at the start of a run.
CACHE_KEEP_BYTES = 1 << 30
_CACHE = os.environ.setdefault("JAXDECODE_TEST_JAX_CACHE", str(Path(__file__).resolve().parent.parent
                                                                   / ".pytest_cache" / "jaxdecode-jax-cache"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _prune_cache(folder: str, keep: int) -> None:
    """Removes the oldest entries of ``folder`` until the rest fit in ``keep`` bytes."""
    try:
        entries = [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(folder) if e.is_file()]
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= keep:
            break
        with contextlib.suppress(OSError):
            os.remove(path)
        total -= size


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controlling process, before the workers compile
        _prune_cache(_CACHE, CACHE_KEEP_BYTES)


# The quick subset for the inner loop, `python -m pytest -n auto -m quick` (docs/testing.md): a few
# tests of every file, chosen for what they cover at little cost (every layer: the rules, each loop
# on the character model against its plain reference, the Hugging Face fixtures' logits and greedy
# ids against transformers, the engines, the command line, the package layout). A test joins it
# with ``@pytest.mark.quick`` (every parametrization), or with ``@pytest.mark.quick_ids("native-5",
# ...)`` (those parametrizations alone). A test marked ``slow`` cannot be quick.
# tests/project/test_quick_subset.py checks that every test file has a quick test and that every id
# named selects a test.

# The ids of quick_ids marks that selected no test of a file this run collected whole (a renamed
# parametrization); tests/project/test_quick_subset.py fails on any.
UNMATCHED_QUICK: list[str] = []


def _mark_quick(config, items):
    named, matched = {}, set()
    for item in items:
        ids = item.get_closest_marker("quick_ids")
        if ids is not None:
            key = (item.path.name, getattr(item, "originalname", item.name))
            named[key] = set(ids.args)
            callspec = getattr(item, "callspec", None)
            if callspec is not None and callspec.id in ids.args:
                matched.add((*key, callspec.id))
                item.add_marker(pytest.mark.quick)
        if item.get_closest_marker("quick") is not None and item.get_closest_marker("slow") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked slow and quick: a quick test cannot be slow")
    if not any("::" in str(a) for a in config.args):  # whole files collected
        UNMATCHED_QUICK[:] = [f"{f}::{n}[{i}]" for (f, n), ids in named.items() for i in sorted(ids)
                              if (f, n, i) not in matched]


# What the largest work units cost: CPU seconds of a file's fast tests together (``file:<name>``,
# one xdist group), of an explicit xdist group, or of one slow test (``<file>::<name>``), written by
# `python tools/test_profile.py <folder> --write-units` from a run with $JAXDECODE_TEST_PROFILE
# (docs/testing.md). Only the order of the work depends on it: a unit not named there counts half a
# second a test, a slow test 5 s.
UNIT_SECONDS = json.loads((Path(__file__).resolve().parent / "support" / "unit_seconds.json").read_text())


def _unit(item, fast: bool) -> str:
    """The work unit xdist hands out whole: the test's xdist group, else (a fast test) its file's."""
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return group.args[0] if group.args else group.kwargs.get("name", "default")
    return f"file:{item.path.name}" if fast else f"{item.path.name}::{item.name}"


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Work units, longest first. xdist hands them out in this order (``--no-loadscope-reorder`` in
    pyproject.toml; by default it reorders them by their number of tests, which put every slow
    test, a unit of one, at the end of the run), so the run ends on short units, not on one worker
    finishing a minute-long test while the other waits.

    A file's fast tests are one unit (an xdist group per file) and run on one worker: they share
    their models and so their compiled programs, which one process then traces and compiles once
    instead of each worker doing it again. A slow test is a unit of its own, unless it shares an
    expensive reference with others through an xdist group of theirs.

    The marks go on before the other hooks run (``-m`` selects by them, xdist reads the groups);
    the order is set after them, pytest's own reordering by fixture included (the order within a
    unit stays pytest's: a session fixture's parameters are not set up again and again)."""
    _mark_quick(config, items)
    fast = {item: item.get_closest_marker("slow") is None for item in items}
    for item in items:
        item.stash[_UNIT] = _unit(item, fast[item])
        if fast[item] and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.stash[_UNIT]))
    result = yield
    per_unit = collections.Counter(item.stash[_UNIT] for item in items)
    cost = {u: UNIT_SECONDS.get(u, (0.5 if u.startswith("file:") else 5.0) * n) for u, n in per_unit.items()}
    items[:] = sorted(items, key=lambda item: (-cost[item.stash[_UNIT]], item.stash[_UNIT]))  # stable
    return result


_UNIT = pytest.StashKey[str]()


# $JAXDECODE_TEST_PROFILE=<folder>: each process writes one line of JSON a test to
# <folder>/<worker>.jsonl: wall and CPU seconds (this process's threads, and the processes it
# started), and JAX's compile events (jax.monitoring): tracing, lowering, XLA compiling, and the
# persistent cache's hits. `python tools/test_profile.py <folder>` sums them by file
# (docs/testing.md, "Where the suite's time goes").
_PROFILE = os.environ.get("JAXDECODE_TEST_PROFILE")
_EVENTS = collections.Counter()
if _PROFILE:
    import jax.monitoring

    def _on_duration(event, secs, **_):
        _EVENTS[event + ":s"] += secs
        _EVENTS[event + ":n"] += 1

    def _on_event(event, **_):
        _EVENTS[event + ":n"] += 1

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _PROFILE:
        yield
        return
    import json
    import resource
    import time

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    before = dict(_EVENTS)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0, c0 = time.time(), time.process_time()
    yield
    t1, c1 = time.time(), time.process_time()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    events = {k: round(v - before.get(k, 0), 4) for k, v in _EVENTS.items() if v != before.get(k, 0)}
    line = {"test": item.nodeid, "worker": worker, "start": t0, "wall": t1 - t0, "cpu": c1 - c0,
            "child_cpu": (kids1.ru_utime + kids1.ru_stime) - (kids.ru_utime + kids.ru_stime),
            "slow": item.get_closest_marker("slow") is not None,
            "quick": item.get_closest_marker("quick") is not None, "unit": item.stash.get(_UNIT, None),
            "events": events}
    os.makedirs(_PROFILE, exist_ok=True)
    with open(os.path.join(_PROFILE, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


# Every compiled CPU program keeps its machine code in a few memory mappings of its own, and JAX
# keeps every program it compiles. A test worker compiles tens of thousands of programs; at the
# kernel's limit on mappings (vm.max_map_count, 65,530 by default) mmap fails inside XLA's
# compiler, which then crashes the worker with a segmentation fault (tools/repro_map_count.py,
# docs/testing.md). So after any test that leaves the worker past half the limit, JAX's caches are
# dropped (the mappings go with the programs; the next tests compile what they need again).
MAP_LIMIT_FILE = "/proc/sys/vm/max_map_count"


def _mappings() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _map_limit() -> int | None:
    try:
        with open(MAP_LIMIT_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


MAP_LIMIT = _map_limit()


@pytest.fixture(autouse=True)
def _bounded_mappings():
    yield
    if MAP_LIMIT is not None and (_mappings() or 0) > MAP_LIMIT // 2:
        import gc

        jax.clear_caches()
        gc.collect()

# Hypothesis draws the same examples on every run (a seed derived from each test), so a failure
# reproduces and a pass means the same thing on every machine; HYPOTHESIS_PROFILE=explore draws
# new examples on each run instead.
settings.register_profile("derandomized", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "derandomized"))

BACKENDS = ("native", "portable")


@pytest.fixture(params=BACKENDS, scope="session")
def backend(request):
    """Each backend in turn: the native CPU layer, then the portable jax.numpy path."""
    return request.param

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def key():
    return jax.random.PRNGKey(0)


def locate_test_corpus() -> str:
    """The corpus named by $JAXDECODE_DATA. Unset: the test is skipped. Set to a path that is not
    a file: the test fails (a misconfigured run must not pass by skipping the corpus tests)."""
    p = os.environ.get("JAXDECODE_DATA")
    if not p:
        pytest.skip("the corpus is not available: set $JAXDECODE_DATA to Tiny Shakespeare's input.txt")
    if not Path(p).is_file():
        pytest.fail(f"$JAXDECODE_DATA names {p}, which is not a file: point it at Tiny Shakespeare's "
                    f"input.txt, or unset it to skip the tests that need the corpus", pytrace=False)
    return p


@pytest.fixture(scope="session")
def corpus_path():
    """See :func:`locate_test_corpus`."""
    return locate_test_corpus()


@pytest.fixture(scope="session")
def tiny_model():
    """A small random-weight model (V=12, T=16) with a readable vocabulary: (cfg, params, vocab)."""
    from jaxdecode.models.charlm.transformer import ModelConfig, init_params
    from jaxdecode.io.vocab import Vocab

    cfg = ModelConfig(V=12, T=16, d=32, L=2, heads=4)
    params = init_params(cfg, jax.random.PRNGKey(42))
    # sharper than the 0.02 init so that distributions are far from uniform
    params = jax.tree_util.tree_map(lambda a: a * 3.0, params)
    return cfg, params, Vocab(" abcdefghi.\n")


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_model, tmp_path_factory):
    """``tiny_model`` saved as a checkpoint folder (for the command line)."""
    from jaxdecode.models import checkpoint

    cfg, params, vocab = tiny_model
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    checkpoint.save(path, params, cfg, vocab, meta={"note": "random weights"})
    return str(path)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model, backend):
    """``tiny_model`` as a LanguageModel on each backend."""
    from jaxdecode.models.checkpoint import LanguageModel

    cfg, params, vocab = tiny_model
    return LanguageModel(params=params, cfg=cfg, vocab=vocab, meta={}, backend=backend)


@pytest.fixture(autouse=True)
def _optimized(request):
    """A test marked ``optimized`` compiles at XLA's backend optimization level 1, not the suite's lowest:
    for tests whose programs run for seconds (tens of thousands of rows, hundreds of forwards of
    the shipped model), where optimized code saves more than its longer compile costs."""
    if not request.node.get_closest_marker("optimized"):
        yield
        return
    from support.compiled import optimized

    with optimized():
        yield
