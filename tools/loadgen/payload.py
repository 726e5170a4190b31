"""Block keys and deterministic, self-checking block payloads.

A payload is a pure function of its key and length, so any reader can verify
what it got back without keeping a copy. Layout of ``block_payload(key, n)``
(bytes, truncated to ``n``):

* bytes 0..7: ``n | writer << 48`` as unsigned little-endian 64-bit (the
  length catches truncation; ``writer`` names the worker that wrote the block,
  0 = unnamed),
* bytes 8..23: a 16-byte keyed digest of the key and writer (distinct per key),
* the rest: the 64-byte BLAKE2b digest of the key, repeated.

:func:`payload_writer` checks a payload read back and says who wrote it, which
is how a replay counts hits served from blocks another worker wrote.
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_WRITER", "block_key", "block_payload", "payload_writer", "verify_payload"]

_HEAD_PERSON = b"kvm-lg-head"
_DIGEST_BYTES = 64
_HEADER_BYTES = 24
_LENGTH_BITS = 48
#: Largest writer id a payload can carry.
MAX_WRITER = (1 << 16) - 1


def block_key(namespace: str, hash_id: int) -> str:
    """Store key of block ``hash_id`` in ``namespace``: ``"{namespace}-{hash_id:x}"``."""
    return f"{namespace}-{hash_id:x}"


def block_payload(key: str, nbytes: int, writer: int = 0) -> bytes:
    """Deterministic payload of ``nbytes`` bytes for ``key`` written by ``writer``
    (several GB/s for 4-64 KiB).  Below 8 bytes the writer is not recorded."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not 0 <= writer <= MAX_WRITER or nbytes >> _LENGTH_BITS:
        raise ValueError(f"writer must be in [0, {MAX_WRITER}] and nbytes < 2**{_LENGTH_BITS}")
    raw = key.encode("utf-8")
    pattern = hashlib.blake2b(raw, digest_size=_DIGEST_BYTES).digest()
    # The digest covers the writer too, so a damaged writer field does not pass
    # as another writer (writer 0 keeps the unnamed layout byte for byte).
    salted = raw if not writer else raw + b"\0" + writer.to_bytes(2, "little")
    header = (nbytes | writer << _LENGTH_BITS).to_bytes(8, "little") + hashlib.blake2b(
        salted, digest_size=16, person=_HEAD_PERSON
    ).digest()
    reps = -(-max(nbytes, _HEADER_BYTES) // _DIGEST_BYTES)
    buf = bytearray(pattern * reps)
    buf[:_HEADER_BYTES] = header
    del buf[nbytes:]
    return bytes(buf)


def payload_writer(key: str, data: bytes | bytearray | memoryview) -> int | None:
    """Writer id of a valid payload of ``key`` (0 below 8 bytes); ``None`` if ``data``
    is not exactly ``block_payload(key, len(data), writer)`` for some writer."""
    n = len(data)
    writer = 0
    if n >= 8:
        word = int.from_bytes(bytes(data[:8]), "little")
        if word & ((1 << _LENGTH_BITS) - 1) != n:
            return None
        writer = word >> _LENGTH_BITS
    return writer if block_payload(key, n, writer) == data else None


def verify_payload(key: str, data: bytes | bytearray | memoryview) -> bool:
    """True iff ``data`` is exactly ``block_payload(key, len(data), writer)`` for some writer."""
    return payload_writer(key, data) is not None
