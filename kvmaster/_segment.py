"""Shared-memory segments: the data plane on one host.

A segment is a file ``/dev/shm/<name>`` created by its owner with mode 0600
and mapped by every client on the host that reads or writes it.  Bytes move
between mappings directly; the master only hands out offsets.

The standard library's ``multiprocessing.shared_memory`` is not used because
(before Python 3.13) it registers every attach with a resource tracker that
unlinks the segment when the *attaching* process exits.

Names: ``kvmaster-[<tag>-]<16 hex>.owner-<16 hex>`` for clients' segments, the last
part the owner's fingerprint (:func:`owner_fingerprint` of its CURVE public key, or
of its client id without CURVE), which the master checks against the mounting client
(so nobody mounts a name made by someone else, whatever the master remembers); a
master's own segment (``--master-segment-size``) adds who created it instead,
``.master-<pid>-<start>-<pidns>`` (its pid, the process start time in clock ticks
since boot, and the inode of its pid namespace), so that a segment left behind by a
master that was killed can be told from a live one's and removed
(:func:`remove_stale_segments`).

A segment file is mapped only if it is a regular file with one link, opened
without following a symlink (:func:`check_segment_file`): a symlink or a hard link
under a segment name would alias another file, another tenant's segment included.

In use: every process that uses a segment (its creator and every attacher) takes a
shared ``flock`` on the file.  A lock belongs to the open file, which the creator's
mapping and an attacher's descriptor keep open, so it lasts exactly as long as they do
(until ``close`` or the process's exit), and it is seen from any pid namespace that
shares the file.  A file on which an exclusive lock can be taken is used by no process
of this package.

A peer's segment is read and written with ``pread``/``pwrite`` on a descriptor kept
open (:meth:`Segment.read`, :meth:`Segment.read_into`, :meth:`Segment.write`), not
through a mapping: its owner may shrink the file (``ftruncate``) at any moment, and a
copy through a mapping past the file's new end kills the copying process with SIGBUS.
A read past the end is a short read instead (:class:`SegmentShrunk`, a TRANSFER_FAIL
for the client), a write past it extends the file again.  Checking the file's size
(``fstat``) before a copy through the mapping would not do: the owner can shrink the
file between the check and the copy.  Only the creator copies through its mapping
(``buf``): a process that shrinks its own segment kills itself alone.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
from typing import Any

from kvmaster import errors as E
from kvmaster._alloc import ALIGN

__all__ = ["CLIENT_NAME", "RAW_COPY_MIN", "SHM_DIR", "Segment", "SegmentFileError",
           "SegmentShrunk", "check_segment_file", "check_shm_room", "host_id",
           "master_segment_name", "name_fingerprint", "new_segment_name", "owner_fingerprint",
           "raw_address", "remove_stale_segments", "segment_tag", "shm_free_bytes",
           "unlink_segment"]

SHM_DIR = "/dev/shm"
# Pages are not faulted in by mmap (MAP_POPULATE faults a 4 GiB segment in for
# seconds with the GIL held, which stopped every other thread of the process, a
# heartbeat included): the file's pages are allocated with fallocate and the
# mapping's page tables filled with MADV_POPULATE_WRITE, in chunks, by a thread
# (both calls release the GIL), because a first touch of a tmpfs page inside a put
# costs more than copying the 4 KiB into it.
_MAP_FLAGS = mmap.MAP_SHARED
#: Up to this size a new segment is allocated and faulted in before create()
#: returns; a larger one in the background, one chunk of this size at a time.
POPULATE_CHUNK = 64 << 20
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+
#: A copy of at least this many bytes to or from a created segment's mapping is a
#: ``memmove`` through ctypes, which releases the GIL (other threads of the process,
#: a checksum of the bytes included, run meanwhile); a smaller one a memoryview slice
#: assignment (no call overhead, GIL held).  A ctypes export of the mapping is held
#: during the copy, so a ``close`` meanwhile leaves the mapping in place (BufferError,
#: see :meth:`Segment.close`) instead of unmapping it under the copy.
RAW_COPY_MIN = 256 << 10
_memmove = ctypes.memmove
NAME_PREFIX = "kvmaster-"
log = logging.getLogger(__name__)


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


#: The part of a client's segment name before its owner's fingerprint.
OWNER_MARK = ".owner-"
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")


def owner_fingerprint(identity: str) -> str:
    """The owner part of a client's segment names: the first 16 hex digits of the
    SHA-256 of ``identity``, the client's CURVE public key in Z85 (the master's ZAP
    User-Id) or, without CURVE, its client id."""
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def name_fingerprint(name: str) -> str | None:
    """The owner fingerprint a segment name ends with (``....owner-<16 hex>``), or None."""
    _, mark, fp = name.rpartition(OWNER_MARK)
    return fp if mark and _FINGERPRINT.fullmatch(fp) else None


def new_segment_name(owner: str = "") -> str:
    """``kvmaster-<16 hex>``, or ``kvmaster-<tag>-<16 hex>`` under KVMASTER_SEGMENT_TAG,
    followed by ``.owner-<owner>`` when ``owner`` (a :func:`owner_fingerprint`) is
    given: a client's segment.  Raises ValueError for a bad tag (see
    :func:`segment_tag`) or an owner that is not 16 hex digits."""
    tag = segment_tag()
    if owner and not _FINGERPRINT.fullmatch(owner):
        raise ValueError(f"segment owner {owner!r}: expected 16 hex digits")
    tail = f"{OWNER_MARK}{owner}" if owner else ""
    return f"{NAME_PREFIX}{tag + '-' if tag else ''}{secrets.token_hex(8)}{tail}"


#: A master's own segment: ``kvmaster-[<tag>-]<16 hex>.master-<pid>-<start>-<pidns>``.
MASTER_NAME = re.compile(r"kvmaster-(?:([a-z0-9_]{1,32})-)?[0-9a-f]{16}"
                         r"\.master-(\d{1,10})-(\d{1,20})-(\d{1,20})")
#: A client's segment: ``kvmaster-[<tag>-]<16 hex>.owner-<16 hex>`` (group 1: the tag,
#: if any; group 2: the owner's fingerprint).
CLIENT_NAME = re.compile(r"kvmaster-(?:([a-z0-9_]{1,32})-)?[0-9a-f]{16}\.owner-([0-9a-f]{16})")
#: Any segment file name this package makes, or made before names carried their
#: owner (group 1: the tag, if any).
ANY_NAME = re.compile(r"kvmaster-(?:([a-z0-9_]{1,32})-)?[0-9a-f]{16}"
                      r"(?:\.master-\d+-\d+-\d+|\.owner-[0-9a-f]{16})?")


class SegmentFileError(ValueError):
    """A segment name whose file may not be mapped or mounted: not a name of this
    package, missing, not a regular file (a symlink, a directory, a device), linked
    under another name too, or smaller than the size it is mounted with."""


def check_segment_file(name: str, st: os.stat_result | None = None,
                       min_size: int = 0) -> os.stat_result:
    """Check that ``/dev/shm/<name>`` may be used as a segment: a name of
    :data:`ANY_NAME`'s form and a regular file with one link of at least
    ``min_size`` bytes.  ``st``: the file's ``fstat`` (of a descriptor opened with
    O_NOFOLLOW); without it the path is ``lstat``-ed (a symlink is never followed).
    Returns the stat; raises SegmentFileError (one line: why)."""
    if not ANY_NAME.fullmatch(name):
        raise SegmentFileError(f"segment name {name!r} is not a {NAME_PREFIX} segment name")
    if st is None:
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))
        except OSError as exc:
            raise SegmentFileError(f"segment file {SHM_DIR}/{name}: "
                                   f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SegmentFileError(f"segment file {SHM_DIR}/{name} is not a regular file "
                               "(a symlink?)")
    if st.st_nlink != 1:
        raise SegmentFileError(f"segment file {SHM_DIR}/{name} has {st.st_nlink} links "
                               "(a hard link aliases another file)")
    if st.st_size < min_size:
        raise SegmentFileError(f"segment file {SHM_DIR}/{name} has {st.st_size} bytes, "
                               f"less than the {min_size} it is mounted with")
    return st


def _stat_fields(pid: int) -> list[bytes]:
    """Fields 3.. of ``/proc/PID/stat`` (state first); [] if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # The command name (field 2) may hold spaces and parentheses: split after it.
        return data[data.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return []


def process_start_time(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat``
    field 22), 0 if it cannot be read.  With the pid it names one process: a pid
    reused by a later process has a later start time."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def _alive(pid: int, start: int) -> bool:
    """Whether the process ``pid`` started at ``start`` (0: any) still runs.  A zombie
    (exited, not yet reaped by its parent) maps nothing any more: not alive.  When
    /proc cannot tell, alive."""
    if not os.path.exists(f"/proc/{pid}"):
        return False
    fields = _stat_fields(pid)
    if not fields:
        return os.path.exists(f"/proc/{pid}")
    if fields[0] in (b"Z", b"X"):
        return False
    try:
        return not start or int(fields[19]) == start
    except (IndexError, ValueError):
        return True


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 if it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def master_segment_name() -> str:
    """Name of a master's own segment: :func:`new_segment_name` followed by
    ``.master-<pid>-<start time>-<pid namespace>`` of the calling process.  Raises
    ValueError for a bad KVMASTER_SEGMENT_TAG."""
    pid = os.getpid()
    return f"{new_segment_name()}.master-{pid}-{process_start_time(pid)}-{pid_namespace()}"


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


def _fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def shm_free_bytes() -> int | None:
    """Bytes an unprivileged process may still allocate in SHM_DIR (statvfs
    ``f_bavail``); None when it cannot be read."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _too_small(size: int, free: int | None, knob: str) -> E.InvalidParams:
    have = "too little" if free is None else f"{_fmt_bytes(free)} free"
    return E.InvalidParams(
        f"{SHM_DIR} has {have} for a segment of {_fmt_bytes(size)} ({size} bytes): give "
        f"this host or container more shared memory (docker run --shm-size=..., a "
        f"Kubernetes emptyDir with medium: Memory) or set a smaller {knob}",
        op="setup")


def check_shm_room(size: int, knob: str = "global_segment_size") -> None:
    """Raise InvalidParams (naming ``--shm-size`` and ``knob``, the setting that chose
    the size) when SHM_DIR has less than ``size`` bytes free: a segment over the free
    space would be mapped, then kill its process with SIGBUS at the first write past
    it."""
    free = shm_free_bytes()
    if free is not None and free < size:
        raise _too_small(size, free, knob)


_libc: Any = None


def _madvise() -> Any:
    """libc's madvise through ctypes (which releases the GIL during the call); None
    when it cannot be loaded."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            fn = lib.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _libc = fn
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _address(mm: mmap.mmap) -> int:
    """Start address of a mapping (the ctypes view that tells it is dropped at once,
    so that it does not keep the mapping from closing)."""
    probe = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


#: Most buffers one preadv/pwritev takes (Linux's IOV_MAX).
_IOV_MAX = 1024
#: A gap shorter than the allocation alignment between two adjacent ranges is the
#: padding of the first one's allocation.
_ALIGN = ALIGN
_ZEROS = memoryview(bytes(_ALIGN))


def raw_address(obj: Any) -> tuple[int, Any, int] | None:
    """``(start address, keeper, size in bytes)`` of a C-contiguous byte buffer,
    ``keeper`` an object to hold while the address is used (a bytes object itself, or a
    ctypes export of a writable buffer, which keeps that buffer from being resized or
    unmapped meanwhile); the size is read once the export holds, so a copy bounded by
    it stays inside the buffer.  None for a buffer that gives none (read-only and not
    bytes, or empty)."""
    if type(obj) is bytes:
        return (ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value or 0), obj, len(obj)
    try:
        probe = ctypes.c_char.from_buffer(obj)
        size = memoryview(obj).nbytes
    except (TypeError, ValueError, BufferError):
        return None
    return ctypes.addressof(probe), probe, size


class SegmentShrunk(OSError):
    """A read of a peer's segment ended early: its owner shrank the file under the
    range read (the bytes that were there are gone)."""


class _Populate:
    """Allocates a segment file's pages (``fd`` given: fallocate, so that a /dev/shm
    that runs out fails here and not as a SIGBUS in a later write) and faults the
    mapping's page tables in (MADV_POPULATE_WRITE), chunk by chunk, in a daemon
    thread; neither call holds the GIL.  :meth:`stop` ends it between two chunks."""

    __slots__ = ("_addr", "_fd", "_size", "_stop", "_thread", "error")

    def __init__(self, fd: int | None, addr: int, size: int) -> None:
        self._fd = fd
        self._addr = addr
        self._size = size
        self._stop = threading.Event()
        #: The OSError that ended the allocation early, if any.
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvmaster-segment-populate")

    def start(self) -> _Populate:
        self._thread.start()
        return self

    def run_here(self) -> None:
        """Do the whole job in the calling thread (small segments); raises the
        OSError of a failed allocation."""
        self._run()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        madvise = _madvise()
        try:
            for off in range(0, self._size, POPULATE_CHUNK):
                if self._stop.is_set():
                    return
                n = min(POPULATE_CHUNK, self._size - off)
                if self._fd is not None:
                    os.posix_fallocate(self._fd, off, n)
                if madvise is not None and madvise(self._addr + off, n,
                                                   _MADV_POPULATE_WRITE) != 0 \
                        and ctypes.get_errno() == errno.EINVAL:  # kernel before 5.14
                    madvise = None
        except OSError as exc:
            self.error = exc
            if self._thread.is_alive():  # (run_here raises it instead)
                log.error("[segment] could not allocate the segment's pages in %s (%s): "
                          "writes past the free space will fail", SHM_DIR, exc)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def done(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the job to end; True when it has."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join()


class Segment:
    """One segment file: created (``owner``: mapped, ``buf`` a writable memoryview of
    it) or attached (a peer's: a descriptor kept open, read and written with
    pread/pwrite, see the module docstring).  :meth:`read`, :meth:`read_into` and
    :meth:`write` work on both.

    Creating or attaching one returns at once, whatever its size: a created segment's
    pages are allocated and faulted in by a background thread (:meth:`wait_populated`)."""

    __slots__ = ("_buf", "_fd", "_mmap", "_populate", "name", "owner", "size")

    def __init__(self, name: str, size: int, owner: bool, mm: mmap.mmap | None,
                 fd: int = -1) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap = mm
        self._buf: memoryview | None = None if mm is None else memoryview(mm)
        #: The attached segment's descriptor (-1 for a created one).
        self._fd = fd
        self._populate: _Populate | None = None

    @property
    def buf(self) -> memoryview:
        """A writable memoryview of the whole file.  An attached segment is mapped on
        first use (tests and tools only): a copy through it past the end of a file its
        owner shrank raises SIGBUS, so the client's data paths never use it."""
        b = self._buf
        if b is None:
            if self._fd < 0:
                raise ValueError(f"segment {self.name} is closed")
            self._mmap = mmap.mmap(self._fd, self.size, flags=_MAP_FLAGS)
            b = self._buf = memoryview(self._mmap)
        return b

    # ------------------------------------------------------------- copies

    def raw(self) -> tuple[int, Any]:
        """``(start address, export)`` of a created segment's mapping: hold the export
        while copying through the address (a close meanwhile then leaves the mapping
        in place).  Raises ValueError when the segment is closed."""
        mm = self._mmap
        if mm is None or self._buf is None or not self.owner:
            raise ValueError(f"segment {self.name} is not mapped here")
        probe = ctypes.c_char.from_buffer(mm)  # (ValueError once the mapping is closed)
        return ctypes.addressof(probe), probe

    def _check_range(self, off: int, n: int) -> None:
        """A raw copy stays inside the mapping (ValueError, as a slice past it raises)."""
        if off < 0 or n < 0 or off + n > self.size:
            raise ValueError(f"range {off}+{n} is outside segment {self.name} "
                             f"({self.size} bytes)")

    def read(self, off: int, size: int) -> bytes:
        """The ``size`` bytes at ``off``.  Raises SegmentShrunk (an attached segment
        whose file now ends before ``off + size``), OSError, ValueError (closed)."""
        if self.owner:  # (a created segment's ``_buf`` is its mapping; released: closed)
            if self._buf is None:
                raise ValueError("segment is closed")
            return self._buf[off:off + size].tobytes()
        fd = self._fd
        if fd < 0:
            raise ValueError(f"segment {self.name} is closed")
        data = os.pread(fd, size, off)
        if len(data) != size:
            raise self._shrunk(off, size, len(data))
        return data

    def read_into(self, off: int, dst: Any) -> None:
        """Fill ``dst`` (a writable byte buffer) with the bytes at ``off``.  Raises as
        :meth:`read`."""
        if self.owner:
            n = memoryview(dst).nbytes
            if n >= RAW_COPY_MIN:
                to = raw_address(dst)
                if to is not None:
                    n = to[2]  # (what the buffer holds now that it cannot change)
                    self._check_range(off, n)
                    base, keep = self.raw()
                    _memmove(to[0], base + off, n)
                    del keep
                    return
            dst[:n] = self.buf[off:off + n]
            return
        fd = self._open_fd()
        view = memoryview(dst).cast("B")
        n = view.nbytes
        got = 0
        while got < n:
            k = os.preadv(fd, [view[got:]], off + got)
            if k <= 0:
                raise self._shrunk(off, n, got)
            got += k

    def write(self, off: int, parts: Any) -> None:
        """Copy the byte buffers ``parts``, one after another, to ``off``.  Raises
        OSError (an attached segment: ENOSPC when SHM_DIR is full), ValueError."""
        if self.owner:
            buf = self.buf
            pos = off
            for part in parts:
                n = len(part)
                if n >= RAW_COPY_MIN:
                    src = raw_address(part)
                    if src is not None:
                        if src[2] < n:  # (shrunk since its size was taken)
                            raise ValueError(f"a part of {src[2]} bytes, {n} expected: it "
                                             "changed during the write")
                        self._check_range(pos, n)
                        base, keep = self.raw()
                        _memmove(base + pos, src[0], n)
                        del keep
                        pos += n
                        continue
                buf[pos:pos + n] = part
                pos += n
            return
        fd = self._open_fd()
        if len(parts) == 1:
            part = parts[0]
            n = part.nbytes if type(part) is memoryview else len(part)
            if os.pwrite(fd, part, off) == n:
                return
        elif len(parts) <= _IOV_MAX:
            total = sum(p.nbytes if type(p) is memoryview else len(p) for p in parts)
            if os.pwritev(fd, parts, off) == total:
                return
        self._write_all(fd, off, parts)  # (a write cut short, or more parts than IOV_MAX)

    def write_each(self, items: Any) -> None:
        """Copy each ``(offset, buffer)`` of ``items``.  On a peer's segment, adjacent
        ranges (in the order given: ascending offsets make the fewest calls) go in one
        pwritev, a gap of under 64 bytes between two of them (the alignment padding of
        the range before, within its allocation) written with zeros.  Raises as
        :meth:`write`."""
        if self.owner:
            buf = self.buf
            for off, b in items:
                buf[off:off + len(b)] = b
            return
        run: list[Any] = []
        start = end = 0
        for off, b in items:
            gap = off - end
            if run and 0 <= gap < _ALIGN and len(run) < _IOV_MAX - 1:
                if gap:
                    run.append(_ZEROS[:gap])
                run.append(b)
            else:
                if run:
                    self.write(start, run)
                run = [b]
                start = off
            end = off + (b.nbytes if type(b) is memoryview else len(b))
        if run:
            self.write(start, run)

    def _write_all(self, fd: int, off: int, parts: Any) -> None:
        pending = [memoryview(p).cast("B") for p in parts]
        pos = off
        while pending:
            k = os.pwritev(fd, pending[:_IOV_MAX], pos)
            if k <= 0:
                raise OSError(errno.EIO, f"segment {self.name}: a write at {pos} wrote nothing")
            pos += k
            # Drop what was written (all of it, on a regular file, unless interrupted).
            while pending and k >= pending[0].nbytes:
                k -= pending[0].nbytes
                pending.pop(0)
            if k:
                pending[0] = pending[0][k:]

    def _open_fd(self) -> int:
        fd = self._fd
        if fd < 0:
            raise ValueError(f"segment {self.name} is closed")
        return fd

    def _shrunk(self, off: int, size: int, got: int) -> SegmentShrunk:
        return SegmentShrunk(errno.EIO, f"segment {self.name} ends before its range "
                                        f"[{off}, {off + size}) (read {got} bytes): its "
                                        "owner shrank the file")

    @classmethod
    def create(cls, size: int, name: str | None = None) -> Segment:
        """Create and map a new segment of ``size`` bytes (owner-only permissions).

        Raises InvalidParams when SHM_DIR has less than ``size`` bytes free (see
        :func:`check_shm_room`).  Up to :data:`POPULATE_CHUNK` bytes are allocated
        before it returns; a larger segment is allocated by a background thread."""
        name = name or new_segment_name()
        knob = "--master-segment-size" if MASTER_NAME.fullmatch(name) else \
            "global_segment_size"
        check_shm_room(size, knob)
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while mapped: "in use" (see module doc)
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
            try:
                job = _Populate(os.dup(fd), _address(mm), size)
                if size <= POPULATE_CHUNK:
                    job.run_here()
            except BaseException:
                mm.close()
                raise
        except OSError as exc:
            os.close(fd)
            unlink_segment(name)
            if exc.errno == errno.ENOSPC:
                raise _too_small(size, shm_free_bytes(), knob) from None
            raise
        except BaseException:
            os.close(fd)
            unlink_segment(name)
            raise
        os.close(fd)
        seg = cls(name, size, True, mm)
        if size > POPULATE_CHUNK:
            seg._populate = job.start()
        return seg

    @classmethod
    def attach(cls, name: str, min_size: int = 0) -> Segment:
        """Open an existing segment (a peer's) of at least ``min_size`` bytes for
        pread/pwrite; nothing is mapped (its owner shrinking the file cannot raise
        SIGBUS here).  Raises FileNotFoundError if it is gone (also when its owner
        unlinks it while it is being opened), SegmentFileError (a
        ValueError) for a name or file that is no segment's (a symlink is not followed;
        a hard link, another kind of file or a smaller file is refused: see
        :func:`check_segment_file`)."""
        if not ANY_NAME.fullmatch(name):
            check_segment_file(name)  # raises, naming the name
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SegmentFileError(f"segment file {SHM_DIR}/{name} is a symlink") from None
            raise
        try:
            st = os.fstat(fd)
            if st.st_nlink == 0:
                # Unlinked between the open and now: its owner left, as if not found.
                raise FileNotFoundError(errno.ENOENT, "segment file removed while opened",
                                        _path(name))
            size = check_segment_file(name, st, min_size).st_size
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while open: "in use" (see module doc)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, size, False, None, fd)

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the background allocation and fault-in to end;
        True when it has (or there was none)."""
        job = self._populate
        return job is None or job.done(timeout)

    def close(self, unlink: bool | None = None) -> None:
        """Unmap; the owner also unlinks the file unless ``unlink`` is False."""
        job = self._populate
        if job is not None:
            job.stop()  # before the unmap: its next chunk would touch a freed range
            self._populate = None
        try:
            if self._buf is not None:
                self._buf.release()
            if self._mmap is not None:
                self._mmap.close()
        except BufferError:
            # A caller still holds a view into the mapping (or a raw copy its export):
            # the kernel unmaps it when the last reference goes.
            pass
        self._mmap = None  # (raw() refuses from now on, as the released view does)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink if unlink is not None else self.owner:
            unlink_segment(self.name)


# ------------------------------------------------------------- stale files


def _shm_users() -> dict[tuple[int, int], set[int]] | None:
    """Files under /dev/shm that processes visible here map or hold open:
    ``{(st_dev, st_ino): pids}``; None without a readable /proc.  Processes whose
    maps cannot be read (another user's, or one that is not dumpable) are skipped;
    the lock covers them."""
    users: dict[tuple[int, int], set[int]] = {}
    prefix = SHM_DIR + "/"
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    if "self" not in entries:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith(prefix):
                        major, minor = fields[3].split(":")
                        dev = os.makedev(int(major, 16), int(minor, 16))
                        users.setdefault((dev, int(fields[4])), set()).add(pid)
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    if not os.readlink(f"{fd_dir}/{fd}").startswith(prefix):
                        continue
                    st = os.stat(f"{fd_dir}/{fd}")
                except OSError:
                    continue  # closed meanwhile
                users.setdefault((st.st_dev, st.st_ino), set()).add(pid)
        except OSError:
            continue  # exited, or not ours to inspect
    return users


def _age(st: os.stat_result, now: float) -> float:
    return now - max(st.st_mtime, st.st_ctime)


def remove_stale_segments(tag: str | None = "", masters_only: bool = True,
                          min_age: float = 60.0, dry_run: bool = False) -> dict[str, Any]:
    """Remove segment files of this host that no live process uses any more.

    ``tag``: only names with this KVMASTER_SEGMENT_TAG ("" = untagged names; None =
    every tag).  A file is removed only if all of these hold:

    * it is a regular ``/dev/shm/kvmaster-...`` file of this package's name forms,
      owned by this process's effective user;
    * a master's segment (``.master-...`` names): its creator ran in this pid
      namespace and is not alive (no running process with that pid and start time);
    * any other segment (a client's; only with ``masters_only=False``): it was not
      modified for ``min_age`` seconds (a process that has just created a file
      locks and maps it a moment later);
    * no process holds the shared lock every kvmaster process takes on a file it maps
      (an exclusive lock is taken, and held while the file is unlinked), and no
      process visible here maps it or holds it open (``/proc/*/maps``,
      ``/proc/*/fd``: also software that maps it without the lock).

    What is not seen: software other than kvmaster (or a kvmaster older than the
    lock) mapping a file from a process whose maps cannot be read here (another pid
    namespace sharing /dev/shm, another user, a process that is not dumpable).

    Returns ``{"removed": [name, ...], "kept": [{"name": ..., "reason": ...}, ...]}``
    over the files considered (``removed`` lists what would go, with ``dry_run``).
    """
    euid = os.geteuid()
    own_ns = pid_namespace()
    now = time.time()
    candidates: list[tuple[str, os.stat_result]] = []
    kept: list[dict[str, str]] = []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        names = []
    for name in names:
        m = ANY_NAME.fullmatch(name)
        if m is None or (tag is not None and (m.group(1) or "") != tag):
            continue
        master = MASTER_NAME.fullmatch(name)
        if masters_only and master is None:
            continue
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        if st.st_uid != euid:
            kept.append({"name": name, "reason": f"owned by uid {st.st_uid}"})
            continue
        if master is not None:
            pid, start, ns = int(master.group(2)), int(master.group(3)), int(master.group(4))
            if not own_ns or ns != own_ns:
                kept.append({"name": name, "reason": "its master ran in another pid namespace"})
                continue
            if _alive(pid, start):
                kept.append({"name": name, "reason": f"its master (pid {pid}) is alive"})
                continue
        elif _age(st, now) < min_age:
            kept.append({"name": name, "reason": f"modified {_age(st, now):.0f} s ago "
                                                 f"(less than {min_age:g} s)"})
            continue
        candidates.append((name, st))
    removed: list[str] = []
    if not candidates:
        return {"removed": removed, "kept": kept}
    users = _shm_users()
    if users is None:
        kept.extend({"name": name, "reason": "/proc cannot be read: cannot tell who maps it"}
                    for name, _ in candidates)
        return {"removed": removed, "kept": kept}
    for name, st in candidates:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile
        try:
            now_st = os.fstat(fd)
            if (now_st.st_dev, now_st.st_ino) != (st.st_dev, st.st_ino):
                continue  # replaced meanwhile: not the file that was checked
            pids = users.get((st.st_dev, st.st_ino))
            if pids:
                kept.append({"name": name, "reason": "mapped or open by pid " +
                             ", ".join(str(p) for p in sorted(pids))})
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                kept.append({"name": name, "reason": "locked by a process that maps it (not "
                                                     "visible here)"})
                continue
            if not dry_run:
                try:
                    if os.lstat(path).st_ino != st.st_ino or not unlink_segment(name):
                        continue
                except OSError:
                    continue
            removed.append(name)
        finally:
            os.close(fd)  # drops the exclusive lock
    return {"removed": removed, "kept": kept}
