"""Evaluation: exact distributions over short continuations, and the studies.

May import everything below it (``models``, ``decoding``, ``speculative``, ``serving``, ``io``);
nothing but ``cli`` imports it.
"""
