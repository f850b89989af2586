import collections
import os
import shutil
import tempfile
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

# One compilation cache on disk for the whole run, shared by the xdist workers: a program that
# several tests (or both workers) build is compiled once and loaded after. Programs are keyed by
# their HLO, the compiler options and the jax version, so a hit is the same program.
# $JAXDECODE_TEST_JAX_CACHE names a directory kept between runs; otherwise the controlling process
# makes one for the run (the workers inherit it through the environment) and removes it at the end.
_OWN_CACHE = "JAXDECODE_TEST_JAX_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["JAXDECODE_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="jaxdecode-test-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ["JAXDECODE_TEST_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session):
    # Only the controlling process (not an xdist worker) removes the run's own cache.
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["JAXDECODE_TEST_JAX_CACHE"], ignore_errors=True)

@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The slow tests first (in their order), then the rest: xdist hands tests out in this order,
    so the longest ones start early and the run does not end on one worker finishing a 60-second
    test while the other waits.

    The rest run a file at a time on one worker (an xdist group per file, the files with the most
    tests first): a file's tests share their models and so their compiled programs, which one
    process then traces and compiles once instead of each worker doing it again."""
    fast = {item: item.get_closest_marker("slow") is None for item in items}
    per_file = collections.Counter(item.path for item in items)
    items[:] = sorted(items, key=lambda item: (fast[item], -per_file[item.path] if fast[item] else 0))
    for item in items:
        if fast[item] and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"file:{item.path.name}"))


# Every compiled CPU program keeps its machine code in a few memory mappings of its own, and JAX
# keeps every program it compiles. A test worker compiles tens of thousands of programs; at the
# kernel's limit on mappings (vm.max_map_count, 65,530 by default) mmap fails inside XLA's
# compiler, which then crashes the worker with a segmentation fault (scripts/repro_map_count.py,
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
    from compiled import optimized

    with optimized():
        yield
