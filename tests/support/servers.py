"""``jaxdecode serve`` processes for one test module, on the harness of ``tests/test_server.py``
(:class:`test_server.ServerProcess`): started together, stopped together with SIGTERM at the end,
each required to exit 0 without a traceback on its stderr (so an unexpected error that a server
logged fails the module even where its answer looked fine)."""

from __future__ import annotations

import contextlib

from test_server import ServerProcess


@contextlib.contextmanager
def serving(**servers: tuple[str, ...]):
    """``{name: ServerProcess}`` for ``name=(serve's arguments...)``; their starts overlap. Use
    ``.ready()`` on one before sending it requests."""
    procs = {name: ServerProcess(*args) for name, args in servers.items()}
    try:
        yield procs
    finally:
        for p in procs.values():
            p.signal()
        failures = []
        for name, p in procs.items():
            try:
                p.stop()
            except BaseException as e:  # stop them all, then report
                failures.append(f"{name}: {e}")
        if failures:
            raise AssertionError("\n".join(failures))
