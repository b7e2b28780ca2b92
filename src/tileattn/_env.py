"""The environment variables tileattn reads on every call, read without ``os.environ.get``'s cost.

A model calls attention in every layer of every step, and each call reads a few switches
(``TILEATTN_BACKEND``, ``TILEATTN_HOPPER``, ``TILEATTN_DEBUG_CHECKS``) so that a change between
calls takes effect. ``os.environ.get`` encodes the name and decodes the value on each read:
~0.6 µs on the 2-core CI machine, two or three times per call. ``getenv`` looks the encoded name
up in the mapping ``os.environ`` keeps (``os.environ._data``, which every assignment to
``os.environ`` updates, as ``os.environ.get`` sees it) and decodes only a value that is set.
Where that mapping is not the POSIX one of bytes (Windows, another Python), it calls
``os.environ.get``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["getenv"]

_ENVIRON = os.environ  # the mapping whose ``_data`` is read: another one put in its place is read by its ``get``
_DATA = getattr(_ENVIRON, "_data", None)
_FAST = isinstance(_DATA, dict) and os.name == "posix" and all(type(k) is bytes for k in list(_DATA)[:8])
_ENCODING = sys.getfilesystemencoding()
_KEYS: dict[str, bytes] = {}


def getenv(name: str, default: str) -> str:
    """``os.environ.get(name, default)``."""
    if not _FAST or os.environ is not _ENVIRON:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = name.encode(_ENCODING, "surrogateescape")
    value = _DATA.get(key)
    return default if value is None else value.decode(_ENCODING, "surrogateescape")
