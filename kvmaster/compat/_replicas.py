"""Replica calls of the facade (Mooncake ``store_py.cpp``: ``get_hostname``,
``get_replica_desc``, ``batch_get_replica_desc``, ``batch_replica_clear``,
``create_copy_task``, ``create_move_task``, ``query_task``, and the probe calls of
Mooncake PR #3801, ``probe_key`` / ``batch_probe_key``), with Mooncake's result types:
``ReplicaDescriptor``, ``MemoryDescriptor``, ``Descriptor`` (a buffer), the enums
``ReplicaStatus``, ``TaskType``, ``TaskStatus`` and ``QueryTaskResponse``.

Segment names.  In Mooncake a client's segment is named by its ``local_hostname``
("localhost:12345"); kvmaster's segments have their own names (the shared-memory
file's).  ``setup`` gives the store's segment its Mooncake name (``get_hostname()``)
as a *label* on the master through :meth:`ReplicaOps._label_segment`
(``Client.label_segment``); placement (``preferred_segment(s)``), replica clears,
copies and moves take a label wherever Mooncake takes a segment name, and
descriptors report it as ``transport_endpoint``.  A name another mounted segment
already has (many engines pass "localhost" to every worker) is not taken: that
store's segment keeps only its own name, which ``get_hostname`` then returns.  The
``get_hostname()`` names of this process's stores are also mapped here, without the
master.

Copy and move tasks.  Mooncake's master queues a task and hands it to a client that
copies the bytes.  Here the requesting store runs it: ``create_copy_task`` /
``create_move_task`` prepare the copy on the master at once (so an unknown key,
OBJECT_NOT_FOUND -704, and unknown or wrong segments, INVALID_PARAMS -600, are
answered by the call, as Mooncake's are), then a worker thread of this store copies
the bytes and commits (TaskStatus PENDING -> PROCESSING -> SUCCESS or FAILED, its
``message`` saying why).  A task is known to the store that created it only
(``query_task`` elsewhere: TASK_NOT_FOUND -1400), and goes with it.  Bounds: at most
:data:`MAX_TASKS_IN_FLIGHT` tasks pending or processing (TASK_PENDING_LIMIT_EXCEEDED
-1401 beyond) and the last :data:`MAX_FINISHED_TASKS` finished ones kept.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvmaster import errors as E
from kvmaster.compat import _setup
from kvmaster.compat._common import Facade, code_of, report_once

#: Tasks pending or processing per store; a create beyond answers -1401.
MAX_TASKS_IN_FLIGHT = 1024
#: Finished tasks a store keeps for ``query_task`` (the oldest forgotten first).
MAX_FINISHED_TASKS = 4096
#: Threads per store that copy the bytes of tasks.
TASK_WORKERS = 4
#: Mooncake ``ErrorCode`` values (mooncake-store/include/types.h) kvmaster has no
#: status for: a task id this store does not know, and the bound on tasks in flight.
TASK_NOT_FOUND = -1400
TASK_PENDING_LIMIT_EXCEEDED = -1401


class ReplicaStatus(enum.IntEnum):
    """Mooncake ``ReplicaStatus`` (mooncake-store/include/replica.h).  kvmaster
    describes readable objects only, so its descriptors are COMPLETE."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(enum.IntEnum):
    """Mooncake ``TaskType`` (mooncake-store/include/task_manager.h)."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    """Mooncake ``TaskStatus`` (mooncake-store/include/task_manager.h)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class Descriptor:
    """Mooncake's buffer descriptor (``AllocatedBuffer::Descriptor``): ``size`` (bytes),
    ``buffer_address`` (kvmaster: the replica's byte offset in its segment, not a
    remote virtual address) and ``transport_endpoint`` (the segment's Mooncake name:
    its label, else its kvmaster name)."""

    __slots__ = ("size", "buffer_address", "transport_endpoint")

    def __init__(self, size: int = 0, buffer_address: int = 0,
                 transport_endpoint: str = "") -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    """Mooncake ``MemoryDescriptor``: the ``buffer_descriptor`` of a memory replica."""

    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor

    def __repr__(self) -> str:
        return f"MemoryDescriptor({self.buffer_descriptor!r})"


class ReplicaDescriptor:
    """Mooncake ``Replica::Descriptor`` of one replica: ``status``, and the
    ``is_memory_replica()`` / ``get_memory_descriptor()`` pair (every kvmaster replica
    is in memory; ``is_disk_replica()`` and ``is_local_disk_replica()`` are False and
    ``get_disk_descriptor()`` raises RuntimeError, as Mooncake's does for a memory
    replica)."""

    __slots__ = ("status", "_memory")

    def __init__(self, memory: MemoryDescriptor,
                 status: ReplicaStatus = ReplicaStatus.COMPLETE) -> None:
        self.status = status
        self._memory = memory

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> Any:
        raise RuntimeError("not a disk replica")

    def __repr__(self) -> str:
        return f"ReplicaDescriptor(status={self.status.name}, {self._memory!r})"


class QueryTaskResponse:
    """Mooncake ``QueryTaskResponse``: ``id`` (the task's ``(high, low)`` id), ``type``
    (:class:`TaskType`), ``status`` (:class:`TaskStatus`), ``created_at_ms_epoch``,
    ``last_updated_at_ms_epoch`` (ms since the epoch), ``assigned_client`` (the
    kvmaster client id of the store running it) and ``message`` (why it failed, else
    "")."""

    __slots__ = ("id", "type", "status", "created_at_ms_epoch", "last_updated_at_ms_epoch",
                 "assigned_client", "message")

    def __init__(self, task_id: tuple[int, int] = (0, 0),
                 task_type: TaskType = TaskType.REPLICA_COPY,
                 status: TaskStatus = TaskStatus.PENDING, created: int = 0, updated: int = 0,
                 assigned_client: str = "", message: str = "") -> None:
        self.id = task_id
        self.type = task_type
        self.status = status
        self.created_at_ms_epoch = created
        self.last_updated_at_ms_epoch = updated
        self.assigned_client = assigned_client
        self.message = message

    def __repr__(self) -> str:
        return (f"QueryTaskResponse(id={self.id}, type={int(self.type)}, "
                f"status={int(self.status)}, created_at={self.created_at_ms_epoch}, "
                f"last_updated_at={self.last_updated_at_ms_epoch}, "
                f"assigned_client={self.assigned_client}, message=\"{self.message}\")")


class ExistOptions:
    """Options of an existence check (Mooncake PR #3801): ``grant_lease`` False (the
    default here) is a probe: no lease, no LRU touch on the master; True is
    ``is_exist``'s check (a use for eviction; leased only on a master run with
    ``--exist-grants-lease``, as Mooncake's ExistKey leases)."""

    __slots__ = ("grant_lease",)

    def __init__(self, grant_lease: bool = False) -> None:
        self.grant_lease = bool(grant_lease)

    def __repr__(self) -> str:
        return f"ExistOptions(grant_lease={self.grant_lease})"


def _local_hostnames() -> dict[str, str]:
    """``get_hostname()`` -> kvmaster segment of the stores of this process."""
    with _setup._hostnames_lock:
        return dict(_setup._hostnames)


def _check_keys(method: str, keys: Any) -> None:
    """TypeError, as pybind11 raises it, for ``keys`` that is not a list of str."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or \
            not all(isinstance(k, str) for k in keys):
        raise TypeError(f"{method}(): incompatible function arguments (keys must be a "
                        f"list of str)")


def _now_ms() -> int:
    return int(time.time() * 1000)


class _Tasks:
    """One store's copy/move tasks: id -> response, bounded (see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[tuple[int, int], QueryTaskResponse] = {}
        self.done: OrderedDict[tuple[int, int], QueryTaskResponse] = OrderedDict()
        #: Creates between their bound check and their entry in ``live``.
        self.reserved = 0
        self.pool = ThreadPoolExecutor(TASK_WORKERS, thread_name_prefix="kvmaster-replica-task")

    def get(self, task_id: tuple[int, int]) -> QueryTaskResponse | None:
        with self.lock:
            return self.live.get(task_id) or self.done.get(task_id)

    def set(self, resp: QueryTaskResponse, status: TaskStatus, message: str = "") -> None:
        with self.lock:
            resp.status = status
            resp.message = message
            resp.last_updated_at_ms_epoch = _now_ms()
            if status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
                self.live.pop(resp.id, None)
                self.done[resp.id] = resp
                while len(self.done) > MAX_FINISHED_TASKS:
                    self.done.popitem(last=False)


_TASKS_LOCK = threading.Lock()


class ReplicaOps(Facade):
    """Mooncake's replica calls; see the module docstring for names and tasks."""

    _tasks: _Tasks | None = None

    # ---------------------------------------------------------------- names

    def _label_segment(self, hostname: str) -> bool:
        """For ``setup``: give this store's segment its Mooncake name (``hostname``,
        what ``get_hostname`` returns) as its label on the master, so that other
        processes' stores can name it too.  False (logged once) without a segment or
        when another mounted segment has that name already."""
        client = self.client
        if not hostname or client.segment_name is None:
            return False
        try:
            client.label_segment(hostname)
        except E.KVMasterError as exc:
            report_once(f"label-{hostname}",
                        f"segment {client.segment_name} keeps its own name: local_hostname "
                        f"{hostname!r} is not taken ({exc})")
            return False
        return True

    def _endpoints(self) -> dict[str, str]:
        """kvmaster segment name -> the Mooncake name to report: its label on the
        master, else the ``get_hostname()`` of a store of this process using it."""
        labels = self.client.segment_labels()
        for name, seg in _local_hostnames().items():
            labels.setdefault(seg, name)
        return labels

    @staticmethod
    def _segment(name: str) -> str:
        """A Mooncake segment name as the master takes it: a store of this process's
        ``get_hostname()`` becomes its kvmaster segment; any other name goes as it is
        (the master resolves labels)."""
        return _setup.segment_name_for(name) if name else name

    # ----------------------------------------------------------- descriptors

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's replicas as Mooncake descriptors; ``[]`` when it is missing or
        on any error (Mooncake ``RealClient::get_replica_desc``).  Grants a read lease,
        as Mooncake's Query does."""
        try:
            size, replicas = self.client.replica_list(key)
            labels = self._endpoints()
        except Exception:  # noqa: BLE001 - Mooncake returns an empty list on failure
            return []
        return [ReplicaDescriptor(MemoryDescriptor(Descriptor(size, off, labels.get(seg, seg))))
                for seg, off in replicas]

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """key -> descriptors for the keys found (missing keys are left out; ``{}`` on
        an error of the whole batch), as Mooncake ``batch_get_replica_desc``."""
        try:
            found = self.client.batch_replica_list(list(keys))
            labels = self._endpoints()
        except Exception:  # noqa: BLE001
            return {}
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key, got in zip(keys, found):
            if got is not None:
                size, reps = got
                out[key] = [ReplicaDescriptor(MemoryDescriptor(
                    Descriptor(size, o, labels.get(s, s)))) for s, o in reps]
        return out

    # ---------------------------------------------------------------- clear

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Clear replicas of this store's own objects whose lease has run out (Mooncake
        ``MasterService::BatchReplicaClear``): all of them with ``segment_name`` "",
        else those on that segment (the object goes with its last replica).  Returns
        the keys cleared; ``[]`` on any error (a batch over ``max_batch`` keys, a bad
        key, no connection), as Mooncake's binding returns an empty list."""
        _check_keys("batch_replica_clear", keys)
        if not isinstance(segment_name, str):
            raise TypeError("batch_replica_clear(): incompatible function arguments "
                            "(segment_name must be a str)")
        try:
            return self.client.replica_clear(list(keys), self._segment(segment_name))
        except Exception:  # noqa: BLE001
            return []

    # --------------------------------------------------------------- probes

    def probe_key(self, key: str, options: ExistOptions | None = None) -> int:
        """1 / 0 at this instant, or a negative code; with ``options.grant_lease`` the
        same check as ``is_exist``, else a probe (no lease, no LRU touch)."""
        try:
            if options is not None and options.grant_lease:
                return int(self.client.is_exist(key))
            return int(self.client.probe_key(key))
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    def batch_probe_key(self, keys: Sequence[str],
                        options: ExistOptions | None = None) -> list[int]:
        """1 / 0 / negative code per position, as :meth:`probe_key`."""
        _check_keys("batch_probe_key", keys)
        if options is not None and options.grant_lease:
            return self._per_key("batch_is_exist", len(keys), list(keys))
        return self._per_key("batch_probe_key", len(keys), list(keys))

    # ---------------------------------------------------------------- tasks

    def _task_table(self) -> _Tasks:
        with _TASKS_LOCK:
            if self._tasks is None:
                self._tasks = _Tasks()
            return self._tasks

    def _create_task(self, task_type: TaskType, key: str, targets: list[str],
                     source: str) -> tuple[tuple[int, int], int]:
        tasks = self._task_table()
        with tasks.lock:
            if len(tasks.live) + tasks.reserved >= MAX_TASKS_IN_FLIGHT:
                return (0, 0), TASK_PENDING_LIMIT_EXCEEDED
            tasks.reserved += 1
        try:
            try:
                client = self.client
                plan = client.copy_prepare(key, targets, source)
            except Exception as exc:  # noqa: BLE001
                return (0, 0), code_of(exc)
            raw = os.urandom(16)
            task_id = (int.from_bytes(raw[:8], "big"), int.from_bytes(raw[8:], "big"))
            now = _now_ms()
            resp = QueryTaskResponse(task_id, task_type, TaskStatus.PENDING, now, now,
                                     client.client_id)
            with tasks.lock:
                tasks.live[task_id] = resp
        finally:
            with tasks.lock:
                tasks.reserved -= 1

        def run() -> None:
            tasks.set(resp, TaskStatus.PROCESSING)
            try:
                client.copy_finish(plan)
            except Exception as exc:  # noqa: BLE001 - the task records why
                tasks.set(resp, TaskStatus.FAILED, f"{type(exc).__name__}: {exc}")
                return
            tasks.set(resp, TaskStatus.SUCCESS)

        try:
            tasks.pool.submit(run)
        except RuntimeError as exc:  # the pool was shut down (interpreter exit)
            tasks.set(resp, TaskStatus.FAILED, str(exc))
        return task_id, 0

    def create_copy_task(self, key: str, targets: Sequence[str]) -> tuple[tuple[int, int], int]:
        """Copy ``key``'s object to each segment of ``targets`` (Mooncake names or
        kvmaster names) that has no replica of it -> ``(task_id, 0)``, or
        ``((0, 0), code)``: INVALID_PARAMS (-600) for no or unknown targets,
        OBJECT_NOT_FOUND (-704), NO_AVAILABLE_HANDLE (-200), -1401 at the bound."""
        if isinstance(targets, (str, bytes)) or not all(isinstance(t, str) for t in targets):
            return (0, 0), -600
        if not targets:
            return (0, 0), -600
        return self._create_task(TaskType.REPLICA_COPY, key,
                                 [self._segment(t) for t in targets], "")

    def create_move_task(self, key: str, source: str,
                         target: str) -> tuple[tuple[int, int], int]:
        """Move ``key``'s replica on ``source`` to ``target`` -> ``(task_id, 0)`` or
        ``((0, 0), code)``: OBJECT_NOT_FOUND (-704); INVALID_PARAMS (-600) for an
        unknown segment, ``source == target`` or no replica on ``source``."""
        if not isinstance(source, str) or not isinstance(target, str) or not source:
            return (0, 0), -600
        return self._create_task(TaskType.REPLICA_MOVE, key, [self._segment(target)],
                                 self._segment(source))

    def query_task(self, task_id: Any) -> tuple[QueryTaskResponse | None, int]:
        """``(QueryTaskResponse, 0)``, or ``(None, TASK_NOT_FOUND -1400)`` for a task
        this store did not create (or has forgotten: see the module doc)."""
        try:
            tid = (int(task_id[0]), int(task_id[1]))
        except (TypeError, ValueError, IndexError):
            return None, -600
        resp = self._task_table().get(tid)
        if resp is None:
            return None, TASK_NOT_FOUND
        return resp, 0
