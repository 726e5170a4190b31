"""Shared-memory segments: the data plane on one host.

A segment is a file ``/dev/shm/<name>`` created by its owner with mode 0600
and mapped by every client on the host that reads or writes it.  Bytes move
between mappings directly; the master only hands out offsets.

The standard library's ``multiprocessing.shared_memory`` is not used because
(before Python 3.13) it registers every attach with a resource tracker that
unlinks the segment when the *attaching* process exits.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import socket

__all__ = ["SHM_DIR", "Segment", "host_id", "new_segment_name", "segment_tag", "unlink_segment"]

SHM_DIR = "/dev/shm"
# Fault the pages in at map time: a first touch of a tmpfs page inside a put
# costs more than copying the 4 KiB into it.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
NAME_PREFIX = "kvmaster-"


def host_id() -> str:
    """Identifier of this host as clients and master report it (the hostname)."""
    return socket.gethostname()


#: Environment variable: a tag put into the names of the segment files this process
#: creates (``kvmaster-<tag>-<16 hex>``), so the files of one deployment or test run
#: can be told apart from another's on the same host.  1-32 of [a-z0-9_].
SEGMENT_TAG_ENV = "KVMASTER_SEGMENT_TAG"
_TAG = re.compile(r"[a-z0-9_]{1,32}")


def segment_tag() -> str:
    """The KVMASTER_SEGMENT_TAG of this process ("" when unset).  Raises ValueError for
    a tag outside 1-32 of [a-z0-9_]."""
    tag = os.environ.get(SEGMENT_TAG_ENV, "")
    if tag and not _TAG.fullmatch(tag):
        raise ValueError(f"{SEGMENT_TAG_ENV}={tag!r}: use 1-32 of a-z, 0-9 and _")
    return tag


def new_segment_name() -> str:
    """``kvmaster-<16 hex>``, or ``kvmaster-<tag>-<16 hex>`` under KVMASTER_SEGMENT_TAG.
    Raises ValueError for a bad tag (see :func:`segment_tag`)."""
    tag = segment_tag()
    return f"{NAME_PREFIX}{tag + '-' if tag else ''}{secrets.token_hex(8)}"


def _path(name: str) -> str:
    if "/" in name or not name or name.startswith("."):
        raise ValueError(f"invalid segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def unlink_segment(name: str) -> bool:
    """Remove the segment file if it exists; True if it did."""
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


class Segment:
    """A mapping of one segment file.  ``buf`` is a writable memoryview of it."""

    __slots__ = ("name", "size", "owner", "_mmap", "buf")

    def __init__(self, name: str, size: int, owner: bool, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap = mm
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, size: int, name: str | None = None) -> Segment:
        """Create and map a new segment of ``size`` bytes (owner-only permissions)."""
        name = name or new_segment_name()
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        except BaseException:
            os.close(fd)
            unlink_segment(name)
            raise
        os.close(fd)
        return cls(name, size, True, mm)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment.  Raises FileNotFoundError if it is gone."""
        fd = os.open(_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        return cls(name, size, False, mm)

    def close(self, unlink: bool | None = None) -> None:
        """Unmap; the owner also unlinks the file unless ``unlink`` is False."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            # A caller still holds a view into the mapping; the kernel unmaps it
            # when the last reference goes.
            pass
        if unlink if unlink is not None else self.owner:
            unlink_segment(self.name)
