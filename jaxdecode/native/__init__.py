"""The native CPU layer: C++ decode operations (``csrc/``), their build, and every FFI registration.

May import: ``io`` (paths). Used by the models that choose it; never by a decoding loop.
"""
