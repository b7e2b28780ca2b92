"""Glue between tileattn and other libraries.

Each integration lives in its own module and imports its library only when that module is
imported, so ``import tileattn`` never pulls in transformers:

* ``tileattn.integrations.transformers`` — ``attn_implementation="tileattn"`` for Hugging Face
  transformers models (importing the module registers it; ``register()`` does it explicitly).
"""
