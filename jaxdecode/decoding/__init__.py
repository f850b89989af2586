"""The decoding loops: sampling (with every rule), beam search, exact mode search, contrastive
search, SMC, scoring, the memory budget and the sharded batch.

May import: ``models.base`` (the interface), ``rules``, ``constraints``, ``io``. Never a concrete
model, the native layer, ``serving``, ``speculative``, ``eval`` or ``cli``.
"""
