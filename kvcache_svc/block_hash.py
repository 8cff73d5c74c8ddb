"""Chained block hashes for prefix caching.

A full block is named by SHA-256 over (its parent's hash, its token ids, and on the first block the
request's cache salt), starting from a root that names the model and KV layout. The encoding is fixed
(little-endian int32 token ids, length-prefixed salt), so every process and every restart, and a Redis
tier shared between them, agree on the names.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = b"pagedserve-kv-v1"


def root_hash(model_id: str) -> bytes:
    """The parent of every first block: the model, dtype and block size the K/V were computed with."""
    return hashlib.sha256(HASH_VERSION + b"\0" + model_id.encode()).digest()


def block_hash(parent: bytes, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    digest = hashlib.sha256(parent)
    if salt is not None:
        encoded = salt.encode()
        digest.update(b"S" + struct.pack("<I", len(encoded)) + encoded)
    digest.update(b"T" + struct.pack(f"<{len(token_ids)}i", *token_ids))
    return digest.digest()
