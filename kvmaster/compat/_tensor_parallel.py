"""The tensor calls of the facade that shard a tensor by a parallel layout
(``*_tensor_with_parallelism*``, as Mooncake's ``store_py.cpp``); the tensor format and
the plain and ``with_tp`` calls are in :mod:`kvmaster.compat._tensor`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmaster.compat._common import bad_buffer, log, view
from kvmaster.compat._config import ReplicateConfig
from kvmaster.compat._tensor import (
    INVALID,
    MAX_BATCH,
    TensorOps,
    _as_tensor,
    _Axis,
    _manifest,
    _matches,
    _narrow,
    _parse_axes,
    _parse_manifest,
    _shard_info,
    _shard_range,
    _torch,
    _tp,
    _tp_index,
    _uniform,
    _with_tp_rank,
    _writer_of,
    decode,
    dtype_code,
    parallelism_key,
    tensor_info,
    tp_key,
    writer_shard_key,
)


class ParallelTensorOps(TensorOps):
    """``put/upsert/get_tensor_with_parallelism`` and their batch, ``_from`` and
    ``_into`` forms: a tensor split by its layout's axes, one object per writer shard."""

    # ---------------------------------------------------- with_parallelism

    def _route(self, parallelism: Any, writer: Any) -> tuple[str, Any] | None:
        """Mooncake's ``resolve_parallelism_write_request``: ("direct", None),
        ("writer", (rank, size, split_dim)) or ("axes", axes); None when invalid (a
        writer_partition combined with a parallelism included)."""
        if writer is not None:
            if parallelism is not None:
                log.error("writer_partition cannot be combined with parallelism")
                return None
            w = _writer_of(writer)
            return None if w is None else ("writer", w)
        if parallelism is None:
            return ("direct", None)
        axes = _parse_axes(parallelism)
        return None if axes is None else ("axes", axes)

    def _write_parallel(self, key: str, tensor: Any, route: tuple[str, Any] | None,
                        config: ReplicateConfig | None, upsert: bool) -> int:
        if route is None:
            return INVALID
        kind, arg = route
        if kind == "direct":
            return self._write(key, tensor_info(tensor), config, upsert)
        info = tensor_info(tensor)
        if info is None:
            return INVALID
        if kind == "writer":
            rank, size, sd = arg
            shard = _narrow(info, sd, rank, size, _tp(rank, size, sd))
            if shard is None:
                return INVALID
            rc = self._write(writer_shard_key(key, rank, size, sd), shard, config, upsert)
            return rc or self._write_bytes(
                f"{key}__writer_manifest", _manifest(info.meta.dtype, info.meta.local_shape,
                                                     sd, size), config, upsert)
        axes = arg
        ti = _tp_index(axes)
        if ti is None:  # no TP axis: the tensor is stored whole, labelled with its axes
            shard = _shard_info(info, info.meta.local_shape, axes)
            return self._write(parallelism_key(key, axes), shard, config, upsert)
        _, rank, size, sd, _, _ = axes[ti]
        if len(axes) == 1:  # the tensor is this rank's shard; the global shape inferred
            g = list(info.meta.local_shape)
            if not 0 <= sd < len(g):
                return INVALID
            g[sd] *= size
            if not _uniform(g, sd, size):
                return INVALID
            shard = _shard_info(info, g, axes)
        else:  # the tensor is full: this rank's part of it
            g = list(info.meta.local_shape)
            shard = _narrow(info, sd, rank, size, axes)
        if shard is None:
            return INVALID
        rc = self._write(parallelism_key(key, axes), shard, config, upsert)
        return rc or self._write_bytes(f"{key}__parallelism_manifest",
                                       _manifest(info.meta.dtype, g, sd, size), config, upsert)

    def _write_bytes(self, key: str, value: bytes, config: ReplicateConfig | None,
                     upsert: bool) -> int:
        return self._run("upsert" if upsert else "put", key, value, config)

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: ReplicateConfig | None = None,
                                    writer_partition: Any = None) -> int:
        """Store ``tensor`` under Mooncake's placement rules: no request stores it whole;
        ``writer_partition`` (rank, size, split_dim of a full tensor) stores that part
        as ``key__writer_<r>of<n>_sd<d>`` plus ``key__writer_manifest``; a single TP
        axis takes ``tensor`` as that rank's shard (``key_tp_<rank>``); several axes
        with a TP axis take it as full and store the rank's part under the axes' key;
        axes without TP store it whole under the axes' key.  Only uniform splits:
        INVALID_PARAMS otherwise."""
        return self._write_parallel(key, tensor, self._route(parallelism, writer_partition),
                                    config, False)

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: ReplicateConfig | None = None,
                                       writer_partition: Any = None) -> int:
        return self._write_parallel(key, tensor, self._route(parallelism, writer_partition),
                                    config, True)

    def _batch_parallel(self, keys: list[str], tensors: list[Any], parallelisms: Any,
                        writers: Any, config: ReplicateConfig | None, upsert: bool,
                        one: Any) -> list[int]:
        if self._bad_batch(keys, tensors):
            return [INVALID] * len(keys)
        if parallelisms is not None and writers is not None:
            log.error("writer_partitions cannot be combined with parallelisms")
            return [INVALID] * len(keys)
        if parallelisms is None and writers is None:
            return [one(k, t, None, None) for k, t in zip(keys, tensors)]
        reqs = parallelisms if parallelisms is not None else writers
        if not isinstance(reqs, list) or len(reqs) != len(keys):
            return [INVALID] * len(keys)
        if parallelisms is not None:
            return [one(k, t, p, None) for k, t, p in zip(keys, tensors, reqs)]
        return [one(k, t, None, w) for k, t, w in zip(keys, tensors, reqs)]

    def batch_put_tensor_with_parallelism(self, keys: list[str], tensors_list: list[Any],
                                          parallelisms: Any = None,
                                          config: ReplicateConfig | None = None,
                                          writer_partitions: Any = None) -> list[int]:
        """``put_tensor_with_parallelism`` per position (a list of requests, one per key,
        or none); both lists given is INVALID_PARAMS at every position."""
        return self._batch_parallel(
            keys, tensors_list, parallelisms, writer_partitions, config, False,
            lambda k, t, p, w: self._write_parallel(k, t, self._route(p, w), config, False))

    def batch_upsert_tensor_with_parallelism(self, keys: list[str], tensors_list: list[Any],
                                             parallelisms: Any = None,
                                             config: ReplicateConfig | None = None,
                                             writer_partitions: Any = None) -> list[int]:
        return self._batch_parallel(
            keys, tensors_list, parallelisms, writer_partitions, config, True,
            lambda k, t, p, w: self._write_parallel(k, t, self._route(p, w), config, True))

    def _write_parallel_from(self, key: str, ptr: int, size: int, route: Any,
                             config: ReplicateConfig | None, upsert: bool) -> int:
        if route is None:
            return INVALID
        if route[0] == "direct":
            return self._from(key, ptr, size, config, upsert)
        t = self._decode_at(ptr, size)
        if t is None:
            return INVALID
        if route[0] == "axes":
            axes = route[1]
            ti = _tp_index(axes)
            if ti is not None:  # the buffer is full: every TP rank's shard is written
                _, _, n, sd, _, _ = axes[ti]
                infos = self._tp_infos(t, n, sd, axes)
                if infos is None:
                    return INVALID
                keys = [parallelism_key(key, _with_tp_rank(axes, r)) for r in range(n)]
                return self._first_error(self._write_many(keys, infos, config, upsert))
        return self._write_parallel(key, t, route, config, upsert)

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism: Any = None,
                                         config: ReplicateConfig | None = None,
                                         writer_partition: Any = None) -> int:
        """As ``put_tensor_with_parallelism`` from a full ``[TensorMetadata][data]``
        buffer; with a TP axis every rank's shard is written (Mooncake
        ``execute_tp_tensor_write_from_impl``)."""
        return self._write_parallel_from(key, buffer_ptr, size,
                                         self._route(parallelism, writer_partition),
                                         config, False)

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism: Any = None,
                                            config: ReplicateConfig | None = None,
                                            writer_partition: Any = None) -> int:
        return self._write_parallel_from(key, buffer_ptr, size,
                                         self._route(parallelism, writer_partition),
                                         config, True)

    def _batch_parallel_from(self, keys: list[str], ptrs: list[int], sizes: list[int],
                             parallelisms: Any, writers: Any,
                             config: ReplicateConfig | None, upsert: bool) -> list[int]:
        if self._bad_batch(keys, ptrs, sizes):
            return [INVALID] * len(keys)
        pairs = list(zip(ptrs, sizes))
        return self._batch_parallel(
            keys, pairs, parallelisms, writers, config, upsert,
            lambda k, ps, p, w: self._write_parallel_from(k, ps[0], ps[1], self._route(p, w),
                                                          config, upsert))

    def batch_put_tensor_with_parallelism_from(self, keys: list[str], buffer_ptrs: list[int],
                                               sizes: list[int], parallelisms: Any = None,
                                               config: ReplicateConfig | None = None,
                                               writer_partitions: Any = None) -> list[int]:
        return self._batch_parallel_from(keys, buffer_ptrs, sizes, parallelisms,
                                         writer_partitions, config, False)

    def batch_upsert_tensor_with_parallelism_from(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
            parallelisms: Any = None, config: ReplicateConfig | None = None,
            writer_partitions: Any = None) -> list[int]:
        return self._batch_parallel_from(keys, buffer_ptrs, sizes, parallelisms,
                                         writer_partitions, config, True)

    # ---------------------------------------------- with_parallelism reads

    def _target(self, target: Any) -> tuple[str, list[_Axis] | None] | None:
        if target is None:
            return ("as_stored", None)
        try:
            mode = str(target.mode).lower()
            p = target.parallelism
        except AttributeError:
            return None
        if mode not in ("as_stored", "shard", "full"):
            return None
        if p is None:
            return (mode, None)
        axes = _parse_axes(p)
        return None if axes is None else (mode, axes)

    def _concat(self, keys: list[str], split_dim: int, global_shape: Sequence[int] | None,
                dtype: int | None) -> Any:
        parts = []
        for k in keys:
            t = self.get_tensor(k)
            if t is None:
                return None
            parts.append(t)
        full = _torch().cat(parts, dim=split_dim)
        if global_shape is not None and tuple(full.shape) != tuple(global_shape):
            return None
        if dtype is not None and dtype_code(full.dtype) != dtype:
            return None
        return full

    def _full_from_writers(self, key: str) -> Any:
        m = self._raw(f"{key}__writer_manifest")
        man = None if m is None else _parse_manifest(bytes(m))
        if man is None:
            return None
        dtype, shape, sd, n = man
        return self._concat([writer_shard_key(key, r, n, sd) for r in range(n)], sd, shape,
                            dtype)

    def _full_from_axes(self, key: str, axes: list[_Axis]) -> Any:
        ti = _tp_index(axes)
        if ti is None:  # Mooncake: full reconstruction requires a TP axis
            return None
        _, _, n, sd, _, _ = axes[ti]
        keys = [parallelism_key(key, _with_tp_rank(axes, r)) for r in range(n)]
        full = self._concat(keys, sd, None, None)
        if full is None and len(axes) == 1:
            full = self._full_from_writers(key)
        return full

    def _stored(self, key: str, axes: list[_Axis] | None = None) -> tuple[Any, Any] | None:
        """``(tensor, the object's bytes)`` of the tensor object at ``key`` (when
        ``axes`` are given, only if its shard metadata carries them), or None."""
        got = self._load(key)
        if got is None or axes is not None and not _matches(axes, got[1]):
            return None
        return _as_tensor(*got), got[0]

    def _read_parallel(self, key: str, target: Any) -> tuple[Any, Any] | None:
        """``(tensor, stored object bytes or None when rebuilt)`` for a read target."""
        t = self._target(target)
        if t is None:
            return None
        mode, axes = t
        if mode == "as_stored" and axes is None:
            return self._stored(key)
        if mode == "full" and axes is None:
            return self._rebuilt(self._full_from_writers(key))
        if axes is None:
            return None
        if mode == "full":
            return self._rebuilt(self._full_from_axes(key, axes))
        got = self._stored(parallelism_key(key, axes), axes)
        if got is not None:
            return got
        ti = _tp_index(axes)
        if ti is None:
            return None
        _, rank, n, sd, _, _ = axes[ti]
        if len(axes) == 1:
            got = self._stored(writer_shard_key(key, rank, n, sd), axes)
            if got is not None:
                return got
        full = self._full_from_axes(key, axes) if len(axes) > 1 else \
            self._full_from_writers(key)
        if full is not None and _uniform(tuple(full.shape), sd, n):
            start, size = _shard_range(full.shape[sd], rank, n)
            return full.narrow(sd, start, size).contiguous(), None
        # Mooncake's last resort for a single TP axis: the legacy shard key as it is
        return self._stored(tp_key(key, rank)) if len(axes) == 1 else None

    @staticmethod
    def _rebuilt(t: Any) -> tuple[Any, None] | None:
        return None if t is None else (t, None)

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """Read by a :class:`ReadTarget`: None or "as_stored" without parallelism is
        ``get_tensor``; "full" without parallelism rebuilds from writer shards and
        their manifest; "shard" reads the shard stored for those axes (for a single TP
        axis also a writer shard of the same split), else cuts it from the full tensor
        rebuilt from other TP ranks (a single TP axis last reads ``key_tp_<rank>`` as
        it is); "full" with axes joins every TP rank's shard (axes without TP: None).
        None when nothing matches (Mooncake ``store_py_parallel_read.h``
        ``get_tensor_with_parallelism``)."""
        got = self._read_parallel_logged(key, target)
        return None if got is None else got[0]

    def _read_parallel_logged(self, key: str, target: Any) -> tuple[Any, Any] | None:
        try:
            return self._read_parallel(key, target)
        except Exception as exc:  # noqa: BLE001 - Mooncake returns None
            log.error("get_tensor_with_parallelism(%r): %s", key, exc)
            return None

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: Any = None) -> list:
        if len(keys) > MAX_BATCH:
            return [None] * len(keys)
        if targets is None:
            return self.batch_get_tensor(keys)
        if not isinstance(targets, list) or len(targets) != len(keys):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        """As ``get_tensor_with_parallelism``, the result written into the buffer as a
        ``[TensorMetadata][data]`` object (a stored object's bytes as they are, shard
        metadata included; a rebuilt tensor with FULL metadata) and returned as a
        tensor over it; None when it does not fit."""
        if not buffer_ptr or bad_buffer(buffer_ptr, size):
            return None
        got = self._read_parallel_logged(key, target)
        if got is None:
            return None
        t, raw = got
        if raw is not None:
            blob = bytes(raw)
        else:
            info = tensor_info(t)
            if info is None:
                return None
            blob = info.meta.pack() + bytes(info.data)
        if len(blob) > size:
            return None
        dst = view(buffer_ptr, len(blob))
        dst[:] = blob
        return decode(dst)

    def batch_get_tensor_with_parallelism_into(self, keys: list[str], buffer_ptrs: list[int],
                                               sizes: list[int], targets: Any = None) -> list:
        if self._bad_batch(keys, buffer_ptrs, sizes):
            return [None] * len(keys)
        targets = [None] * len(keys) if targets is None else targets
        if len(targets) != len(keys):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, s, t)
                for k, p, s, t in zip(keys, buffer_ptrs, sizes, targets)]
