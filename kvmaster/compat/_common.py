"""What every family of the Mooncake facade shares: the native client it drives,
return-code conversion, raw-pointer views and once-only reports of what kvmaster
accepts but cannot honour."""

from __future__ import annotations

import bisect
import copy
import ctypes
import logging
import operator
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmaster import _device
from kvmaster import errors as E
from kvmaster.protocol import Status

if TYPE_CHECKING:
    from kvmaster.client import Client

log = logging.getLogger("kvmaster.compat")

_reported: set[str] = set()
_reported_lock = threading.Lock()


def report_once(what: str, text: str) -> None:
    """Log ``text`` at WARNING the first time ``what`` is seen in this process: an
    argument kvmaster accepts and cannot honour (an RDMA device, SSD offload)."""
    with _reported_lock:
        if what in _reported:
            return
        _reported.add(what)
    log.warning("%s", text)


def code_of(exc: BaseException) -> int:
    """Mooncake's return code for an exception: a kvmaster error's own code,
    INTERNAL_ERROR (-1) otherwise."""
    if isinstance(exc, E.KVMasterError):
        return int(exc.code)
    return int(Status.INTERNAL_ERROR)


#: The largest size or address a view can take (ctypes' index limit; no host
#: process maps memory at or above 2**63).
MAX_VIEW = (1 << 63) - 1


def bad_buffer(ptr: int, size: int) -> bool:
    """Whether :func:`view` refuses ``(ptr, size)``."""
    return not 0 <= size <= MAX_VIEW or not 0 <= ptr <= MAX_VIEW or (size != 0 and not ptr)


def view(ptr: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at host address ``ptr``.

    Raises InvalidParams (-600) for a negative size or address, one above
    :data:`MAX_VIEW`, or a null address with bytes to copy (Mooncake's ``size_t``/
    ``uintptr_t`` arguments cannot be negative; a null address would crash the
    process or copy nothing).  ``ptr`` and ``size`` may be any integers with
    ``__index__`` (numpy or 0-d torch integers), as pybind11 takes them; anything
    else raises TypeError."""
    ptr, size = operator.index(ptr), operator.index(size)
    if bad_buffer(ptr, size):
        raise E.InvalidParams(f"bad buffer: address {ptr:#x}, {size} bytes", op="view")
    if size == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def index_lists(lists: Any) -> Any:
    """``lists`` (a list of lists of integers) with every item a Python int: numpy and
    0-d torch integers are taken through ``__index__``, as pybind11 takes them for
    Mooncake's ``std::vector<std::vector<size_t>>`` arguments.  The same object
    when every item is an int already (or ``lists`` is not a list of lists); None
    when an item is not an integer."""
    if not isinstance(lists, (list, tuple)):
        return lists
    out = None
    for i, seq in enumerate(lists):
        if not isinstance(seq, (list, tuple)) or all(type(x) is int for x in seq):
            continue
        try:
            fixed = [operator.index(x) for x in seq]
        except TypeError:
            return None
        if out is None:
            out = list(lists)
        out[i] = fixed
    return lists if out is None else out


def _rw_spans() -> list[tuple[int, int]] | None:
    """This process's readable and writable mappings, merged and sorted; None where
    ``/proc/self/maps`` cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    spans: list[tuple[int, int]] = []
    for line in lines:
        span, perms = line.split(None, 2)[:2]
        if perms[:2] != "rw":
            continue
        lo_s, hi_s = span.split("-")
        lo, hi = int(lo_s, 16), int(hi_s, 16)
        if spans and spans[-1][1] == lo:
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
    return spans


#: The last read of this process's readable and writable mappings: ``(starts, spans)``.
_spans_cache: list[Any] = [None]


def _covered(p: int, n: int, cached: tuple[list[int], list[tuple[int, int]]]) -> bool:
    starts, spans = cached
    j = bisect.bisect_right(starts, p) - 1
    return p > 0 and j >= 0 and p + n <= spans[j][1]


def bad_buffers(all_ptrs: Sequence[Sequence[int]], all_sizes: Sequence[Sequence[int]]
                ) -> set[int]:
    """Positions ``i`` whose buffers ``all_ptrs[i]`` (``all_sizes[i]`` bytes each) are
    not all inside readable and writable memory of this process: the CPU copy of such a
    buffer would crash the process (a device pointer, a made-up address).  Checked
    against the mappings last read from ``/proc/self/maps``, read again when a buffer
    lies outside them (so a call whose buffers were seen before reads nothing); nothing
    is refused where it cannot be read.  Memory the caller unmapped after an earlier
    call is not noticed, as a freed buffer is not by Mooncake."""
    out: set[int] = set()
    cached = _spans_cache[0]
    fresh = False
    for i, (ptrs, sizes) in enumerate(zip(all_ptrs, all_sizes)):
        for p, n in zip(ptrs, sizes):
            if n <= 0 or (cached is not None and _covered(p, n, cached)):
                continue
            if not fresh:
                spans = _rw_spans()
                if spans is None:
                    return set()
                cached = _spans_cache[0] = ([lo for lo, _ in spans], spans)
                fresh = True
                if _covered(p, n, cached):
                    continue
            out.add(i)
            break
    return out


def host_memory(ptr: int, size: int) -> bool:
    """Whether ``[ptr, ptr + size)`` is readable and writable memory of this process
    (Linux ``/proc/self/maps``): refuses a device pointer (CUDA reserves its address
    ranges without access), a freed or made-up address and a range past its mapping.
    True where ``/proc`` cannot be read."""
    if size <= 0 or ptr <= 0:
        return False
    end = ptr + size
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return True
    at = ptr
    for line in lines:
        span, perms = line.split(None, 2)[:2]
        lo_s, hi_s = span.split("-")
        lo, hi = int(lo_s, 16), int(hi_s, 16)
        if hi <= at:
            continue
        if lo > at or perms[:2] != "rw":
            return False
        at = hi
        if at >= end:
            return True
    return False


class Facade:
    """Base of the facade's families: the native client behind a set-up store."""

    _client: Client | None = None

    def _with_device(self, bad: set[int], keys: list[str], ptrs: list[list[int]],
                     sizes: list[list[int]], config: Any, is_put: bool) -> list[int]:
        """A write-once put (``is_put``) or read some of whose positions (``bad``) have
        buffers outside this process's host memory: those on a CUDA device are copied
        by CUDA (kvmaster/_device.py), the others refused INVALID_PARAMS with a log
        line saying why, the rest as usual (``batch_put_from_ptrs`` /
        ``batch_get_into_ptrs``: bytes read per position)."""
        name = "put" if is_put else "get"
        device, refused = _device.split(ptrs, sizes, bad)
        for why in sorted(set(refused.values())):
            log.error("%s: %d keys refused: their buffers are %s", name,
                      sum(1 for r in refused.values() if r == why), why)
        host = [i for i in range(len(keys)) if i not in bad]
        first: dict[str, int] = {}
        if is_put:  # a repeated key is written once, from its first position
            for i, k in enumerate(keys):
                first.setdefault(k, i)
            host = [i for i in host if first[keys[i]] == i]
            device = {i for i in device if first[keys[i]] == i}
        parts: list[tuple[list[int], list[int]]] = []
        for positions, on_device in ((host, False), (sorted(device), True)):
            if not positions:
                continue
            try:
                cfg = config
                if cfg is not None:  # per-key lists follow the keys sent
                    cfg = copy.copy(cfg)
                    for attr in ("group_ids", "session_ids", "kv_sessions"):
                        per_key = getattr(config, attr, None)
                        if per_key is not None:
                            if len(per_key) != len(keys):
                                raise E.InvalidParams(f"{attr} has {len(per_key)} entries "
                                                      f"for {len(keys)} keys", op=name)
                            setattr(cfg, attr, [per_key[i] for i in positions])
                ks = [keys[i] for i in positions]
                ps = [ptrs[i] for i in positions]
                ss = [sizes[i] for i in positions]
                if on_device:
                    got = (_device.put(self.client, ks, ps, ss, cfg) if is_put
                           else _device.get(self.client, ks, ps, ss))
                elif is_put:
                    got = list(self.client.batch_put_from_ptrs(ks, ps, ss, cfg))
                else:
                    got = list(self.client.batch_get_into_ptrs(ks, ps, ss))
            except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
                if on_device:
                    log.error("%s: device copies failed: %s", name, exc)
                got = [code_of(exc)] * len(positions)
            parts.append((positions, got))
        out = _device.merge(len(keys), parts)
        for i, k in enumerate(keys):
            j = first.get(k, i)
            if j != i and i not in refused:
                out[i] = out[j]
        return out

    @property
    def client(self) -> Client:
        """The native client (raises its own exceptions)."""
        if self._client is None:
            raise RuntimeError("setup() has not succeeded")
        return self._client

    def _run(self, method: str, *args: Any, **kw: Any) -> int:
        """Call a native method; 0 or the error's code."""
        try:
            getattr(self.client, method)(*args, **kw)
            return 0
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            return code_of(exc)

    def _per_key(self, method: str, n: int, *args: Any, **kw: Any) -> list[int]:
        """Call a native batch method; its list, or the error's code at every position."""
        try:
            return list(getattr(self.client, method)(*args, **kw))
        except Exception as exc:  # noqa: BLE001
            return [code_of(exc)] * n

    @staticmethod
    def _first_error(codes: list[int]) -> int:
        return next((c for c in codes if c < 0), 0)
