"""jaxdecode: decoding text from language models with pure, jit-compiled JAX functions."""

__version__ = "0.1.0"
