"""Input and output: vocabularies, the corpus, cache and data paths, atomic file writes.

Imports nothing else from jaxdecode.
"""
