"""What a MOUNT_SEGMENT must prove before the master takes it (the front's rules).

A mount claims a name, a size, a host and a transport.  The master believes only
what it can check:

* **The name is the mounting client's.**  A client's segment name ends with
  ``.owner-<fingerprint>`` (:func:`kvmaster._segment.owner_fingerprint`): of the
  connection's CURVE public key with CURVE on (the ZAP User-Id, which the client
  cannot choose), else of the client id of its HELLO.  A name with another
  fingerprint is refused ``ILLEGAL_CLIENT``, so no client can mount (squat) a name
  made by another, also after a master restart, when the master remembers nothing.
  With CURVE every name must carry the fingerprint; without CURVE a name on another
  host may be a foreign client's, without one (a hostile client can claim any
  client id there: without CURVE nothing is contained).
* **A same-host segment is a file of that owner.**  With ``host_id`` equal to the
  master's, the name must be a client segment name (``kvmaster-...owner-...``) of a
  regular file in /dev/shm with one link (``lstat``: a symlink or a hard link would
  alias another file) of at least ``size`` bytes.  Its ``(st_dev, st_ino,
  st_uid)`` is recorded: the master unlinks the file of an expired owner only
  while the name still holds that file.
* **The transfer service is the mounting key's.**  With CURVE a ``tcp://``
  transport must end with ``#curve=<key>`` naming the mounting key (the Python
  client's service uses its client's key pair), so readers authenticate the owner.
* **Sizes are bounded.**  At most ``--max-segment-size`` (the codec already refuses
  more than 2^48), at most ``--max-remote-segment-size`` for a segment on another
  host (whose file the master cannot see: a made-up size there would draw writes
  into nothing), and all mounted segments together at most :data:`MAX_TOTAL_MOUNTED`
  bytes, so no sum the master reports (STATS) can overflow.

Refusals are data: ``(status, one line of text)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmaster._segment import CLIENT_NAME, SegmentFileError, check_segment_file, \
    name_fingerprint, owner_fingerprint
from kvmaster.protocol import Status

__all__ = ["MAX_TOTAL_MOUNTED", "MountProof", "admit_mount", "transport_key"]

#: All segments mounted at once, bytes (2^62): a mount beyond it is refused
#: INVALID_PARAMS, so every sum of sizes fits a signed 64-bit integer.
MAX_TOTAL_MOUNTED = 1 << 62

_CURVE_MARK = "#curve="


@dataclass(frozen=True, slots=True)
class MountProof:
    """What a mount was checked to be: the owner fingerprint its name carries (the
    mounting identity's), the CURVE key that mounted it (None without CURVE), the
    key of its transfer service ("" for none) and, for a file on the master's host,
    its ``(st_dev, st_ino, st_uid)``."""

    fingerprint: str
    key: str | None
    service_key: str
    file_id: tuple[int, int, int] | None


def transport_key(transport: str) -> str:
    """The transfer service key a transport names after ``#curve=`` ("" if none)."""
    return transport.partition(_CURVE_MARK)[2]


def admit_mount(msg: Any, client_id: str, curve_key: str | None, master_host: str,
                config: Any, mounted_bytes: int) -> MountProof | tuple[int, str]:
    """Check a MOUNT_SEGMENT ``msg`` (name, size, host_id, transport) from client
    ``client_id`` whose connection authenticated with ``curve_key`` (z85; None
    without CURVE), on a master of host ``master_host`` with ``config`` (its
    ``max_segment_size``, ``max_remote_segment_size``) where ``mounted_bytes`` are
    mounted already.  -> the proof, or ``(status, text)``: INVALID_PARAMS (a size
    bound, a same-host name that is no owner's segment file), ILLEGAL_CLIENT (a
    name or a transfer service of another owner)."""
    refused = _check_size(msg, master_host, config, mounted_bytes)
    if refused is not None:
        return refused
    own = owner_fingerprint(curve_key if curve_key is not None else client_id)
    fp = name_fingerprint(msg.name)
    whose = "key" if curve_key is not None else "client id"
    if fp is not None and fp != own:
        return Status.ILLEGAL_CLIENT, (
            f"segment {msg.name} belongs to another owner: its name ends with .owner-{fp}, "
            f"the mounting {whose}'s fingerprint is {own}")
    if fp is None and curve_key is not None:
        return Status.ILLEGAL_CLIENT, (
            f"segment {msg.name}: with CURVE a segment name must end with .owner-{own} "
            "(the fingerprint of the mounting key)")
    service_key = transport_key(msg.transport)
    if curve_key is not None and msg.transport.startswith("tcp://") \
            and service_key != curve_key:
        return Status.ILLEGAL_CLIENT, (
            f"segment {msg.name}: with CURVE its transfer service must use the mounting "
            f"key (transport ending with {_CURVE_MARK}<the mounting key>)")
    file_id = None
    if msg.host_id == master_host:
        if not CLIENT_NAME.fullmatch(msg.name):
            return Status.INVALID_PARAMS, (
                f"segment {msg.name} is on the master's host: its name must be "
                f"kvmaster-[<tag>-]<16 hex>.owner-{own}, a file in /dev/shm")
        try:
            st = check_segment_file(msg.name, min_size=msg.size)
        except SegmentFileError as exc:
            return Status.INVALID_PARAMS, str(exc)
        file_id = (st.st_dev, st.st_ino, st.st_uid)
    return MountProof(own, curve_key, service_key, file_id)


def _check_size(msg: Any, master_host: str, config: Any,
                mounted_bytes: int) -> tuple[int, str] | None:
    if msg.size > config.max_segment_size:
        return Status.INVALID_PARAMS, (
            f"segment size {msg.size} is over --max-segment-size={config.max_segment_size}")
    if msg.host_id != master_host and msg.size > config.max_remote_segment_size:
        return Status.INVALID_PARAMS, (
            f"segment size {msg.size} on host {msg.host_id!r} (not the master's) is over "
            f"--max-remote-segment-size={config.max_remote_segment_size}")
    if mounted_bytes + msg.size > MAX_TOTAL_MOUNTED:
        return Status.INVALID_PARAMS, (
            f"segments mounted would exceed {MAX_TOTAL_MOUNTED} bytes in all")
    return None
