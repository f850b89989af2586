"""The ``jaxdecode`` command line: ``main`` (parsing and dispatch), ``common`` (the helpers every
command shares), and one module per group of commands. Nothing else imports it."""

from jaxdecode.cli.main import main

__all__ = ["main"]
