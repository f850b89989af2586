"""The HTTP layer: an OpenAI-compatible server over the engine.

May import: ``serving`` (the engine, through its public methods), ``decoding``, ``rules``,
``constraints``, ``io`` and the model interface. Never ``cli`` or ``eval``.
"""
