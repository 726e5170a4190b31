"""Block keys and deterministic, self-checking block payloads.

A payload is a pure function of its key and length, so any reader can verify
what it got back without keeping a copy. Layout of ``block_payload(key, n)``
(bytes, truncated to ``n``):

* bytes 0..7: ``n`` as unsigned little-endian 64-bit (catches truncation),
* bytes 8..23: a 16-byte keyed digest of the key (distinct per key),
* the rest: the 64-byte BLAKE2b digest of the key, repeated.
"""

from __future__ import annotations

import hashlib

__all__ = ["block_key", "block_payload", "verify_payload"]

_HEAD_PERSON = b"kvm-lg-head"
_DIGEST_BYTES = 64
_HEADER_BYTES = 24


def block_key(namespace: str, hash_id: int) -> str:
    """Store key of block ``hash_id`` in ``namespace``: ``"{namespace}-{hash_id:x}"``."""
    return f"{namespace}-{hash_id:x}"


def block_payload(key: str, nbytes: int) -> bytes:
    """Deterministic payload of ``nbytes`` bytes for ``key`` (several GB/s for 4-64 KiB)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    raw = key.encode("utf-8")
    pattern = hashlib.blake2b(raw, digest_size=_DIGEST_BYTES).digest()
    header = nbytes.to_bytes(8, "little") + hashlib.blake2b(
        raw, digest_size=16, person=_HEAD_PERSON
    ).digest()
    reps = -(-max(nbytes, _HEADER_BYTES) // _DIGEST_BYTES)
    buf = bytearray(pattern * reps)
    buf[:_HEADER_BYTES] = header
    del buf[nbytes:]
    return bytes(buf)


def verify_payload(key: str, data: bytes | bytearray | memoryview) -> bool:
    """True iff ``data`` is exactly ``block_payload(key, len(data))``."""
    n = len(data)
    if n >= 8 and int.from_bytes(bytes(data[:8]), "little") != n:
        return False
    return block_payload(key, n) == data
