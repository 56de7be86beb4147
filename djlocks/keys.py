"""Names in, keys out: how each store identifies a name.

* lease and row tables: ``key`` = SHA-256 of the UTF-8 name, 64 hex digits.
  Database collations may fold case or accents (MySQL's default does); a hex
  digest compares byte for byte everywhere, so ``"A"`` and ``"a"`` stay apart.
"""

from __future__ import annotations

import hashlib


def table_key(name: str) -> str:
    """Return the 64-hex-digit SHA-256 key that lease rows are stored under."""
    return hashlib.sha256(name.encode()).hexdigest()
