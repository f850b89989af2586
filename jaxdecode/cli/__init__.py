"""The ``jaxdecode`` command line: ``app`` (parsing and dispatch, :func:`main`), ``common`` (the helpers every
command shares), and one module per group of commands. Nothing else imports it."""

from jaxdecode.cli.app import main

__all__ = ["main"]
