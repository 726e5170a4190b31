"""Tensor calls of the facade (Mooncake ``mooncake-integration/store/store_py.cpp``:
``put_tensor``, ``get_tensor`` and their batch, ``_into``, ``_from``, ``pub``,
``upsert``, ``_with_tp`` and ``_with_parallelism`` forms; the layout helpers of
``store_py_internal.h``, ``store_py_parallel_write.h``, ``store_py_parallel_read.h``).

A tensor object is Mooncake's byte layout, so either store can read the other's
objects: a 304-byte ``TensorMetadata`` (``integration_utils.h``: a 40-byte
``TensorObjectHeader`` then a 264-byte ``TensorLayoutMetadata``, little-endian,
C layout) followed by the tensor's contiguous bytes.  Shards written for tensor
parallelism carry ``layout_kind`` SHARD, the global and local shapes and up to 4
``LayoutAxis`` records, under Mooncake's key names (``key_tp_<rank>``,
``key__dp_0of2__tp_1of2_sd1``, ``key__writer_<r>of<n>_sd<d>``) with Mooncake's
96-byte manifests (``key__writer_manifest``, ``key__parallelism_manifest``).

torch is imported on first use, so kvmaster runs without it; the calls that need a
CUDA device (``get_tensor_into_cuda``, ``batch_get_tensor_into_cuda``) refuse with
INVALID_PARAMS (-600) and a one-line error where there is none.  Returns follow
Mooncake: a tensor or None for reads, 0 or a negative code for writes, one result
per position for batches."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmaster.compat._common import Facade, bad_buffer, code_of, log, view
from kvmaster.compat._config import ReplicateConfig
from kvmaster.protocol import Status

INVALID = int(Status.INVALID_PARAMS)

# ------------------------------------------------------------------ layout

#: TensorObjectHeader: magic, version, header_size, dtype, ndim, layout_kind,
#: reserved_flags, data_offset, data_bytes (40 bytes).
_HEADER = struct.Struct("<IHHiiIIQQ")
#: TensorShape: 8 int64 dims, -1 past ndim.
_SHAPE = struct.Struct("<8q")
#: LayoutAxis: kind, axis_index, shard_rank, shard_count, split_dim, reserved0, reserved1.
_AXIS = struct.Struct("<iiiiiiq")
#: axis_count, reserved0 of TensorLayoutMetadata.
_COUNTS = struct.Struct("<II")
MAX_DIMS = 8
MAX_AXES = 4
#: sizeof(TensorMetadata) (Mooncake's ``_tensor_metadata_size()``).
TENSOR_METADATA_SIZE = _HEADER.size + 2 * _SHAPE.size + _COUNTS.size + MAX_AXES * _AXIS.size
TENSOR_MAGIC = 0x4D4F4F4E
TENSOR_VERSION = 1
LAYOUT_FULL, LAYOUT_SHARD = 0, 1
#: WriterShardManifestHeader (28 bytes, padded to 32 before the int64 shape): magic,
#: version, header_size, dtype, ndim, split_dim, shard_count, reserved0.
_MANIFEST = struct.Struct("<IHHiiiii4x")
MANIFEST_SIZE = _MANIFEST.size + _SHAPE.size
MANIFEST_MAGIC = 0x574D414E
MANIFEST_VERSION = 1

#: LayoutAxisKind values and the canonical key order (dp, tp, ep, pp).
AXIS_KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
_KIND_NAMES = {v: k for k, v in AXIS_KINDS.items()}

#: TensorDtype code -> (torch dtype name, element size).
DTYPES: dict[int, tuple[str, int]] = {
    0: ("float32", 4), 1: ("float64", 8), 2: ("int8", 1), 3: ("uint8", 1),
    4: ("int16", 2), 5: ("uint16", 2), 6: ("int32", 4), 7: ("uint32", 4),
    8: ("int64", 8), 9: ("uint64", 8), 10: ("bool", 1), 11: ("float16", 2),
    12: ("bfloat16", 2), 13: ("float8_e4m3fn", 1), 14: ("float8_e5m2", 1),
}
#: At most this many keys or tensors in one batch call.
MAX_BATCH = 1 << 16


def _torch() -> Any:
    import torch  # noqa: PLC0415 - torch only when a tensor call is made

    return torch


def dtype_code(dtype: Any) -> int:
    """Mooncake's TensorDtype for a torch dtype; -1 for one it does not store."""
    torch = _torch()
    for code, (name, _) in DTYPES.items():
        if getattr(torch, name, None) == dtype:
            return code
    return -1


@dataclass
class TensorMeta:
    """A parsed ``TensorMetadata``; ``axes`` are LayoutAxis tuples
    ``(kind, axis_index, rank, count, split_dim, reserved0, reserved1)``."""

    dtype: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    data_bytes: int
    layout_kind: int = LAYOUT_FULL
    axes: list[tuple[int, ...]] = field(default_factory=list)
    data_offset: int = TENSOR_METADATA_SIZE

    def pack(self) -> bytes:
        """The 304 bytes Mooncake's ``BuildTensorMetadata`` writes."""
        ndim = len(self.global_shape)
        out = bytearray(TENSOR_METADATA_SIZE)
        _HEADER.pack_into(out, 0, TENSOR_MAGIC, TENSOR_VERSION, TENSOR_METADATA_SIZE,
                          self.dtype, ndim, self.layout_kind, 0, self.data_offset,
                          self.data_bytes)
        pos = _HEADER.size
        for shape in (self.global_shape, self.local_shape):
            _SHAPE.pack_into(out, pos, *(list(shape) + [-1] * (MAX_DIMS - len(shape))))
            pos += _SHAPE.size
        axes = self.axes[:MAX_AXES]
        _COUNTS.pack_into(out, pos, len(axes), 0)
        pos += _COUNTS.size
        for a in axes:
            _AXIS.pack_into(out, pos, *a)
            pos += _AXIS.size
        return bytes(out)


def parse_meta(buf: Any, total: int) -> TensorMeta | None:
    """The metadata at the start of ``buf`` (``total`` bytes of object), or None where
    Mooncake's ``ValidateTensorMetadata`` would refuse it."""
    if total < TENSOR_METADATA_SIZE:
        return None
    mv = memoryview(buf)[:TENSOR_METADATA_SIZE]
    magic, ver, hsize, dtype, ndim, kind, _, off, nbytes = _HEADER.unpack_from(mv, 0)
    if magic != TENSOR_MAGIC or ver != TENSOR_VERSION or hsize != TENSOR_METADATA_SIZE:
        return None
    if dtype not in DTYPES or not 0 <= ndim <= MAX_DIMS or kind > LAYOUT_SHARD:
        return None
    g = _SHAPE.unpack_from(mv, _HEADER.size)
    loc = _SHAPE.unpack_from(mv, _HEADER.size + _SHAPE.size)
    count, _ = _COUNTS.unpack_from(mv, _HEADER.size + 2 * _SHAPE.size)
    if count > MAX_AXES or not TENSOR_METADATA_SIZE <= off <= total or nbytes != total - off:
        return None
    if any(d < 0 for d in g[:ndim] + loc[:ndim]) or any(
            d != -1 for d in g[ndim:] + loc[ndim:]):
        return None
    numel = 1
    for d in loc[:ndim]:
        numel *= d
    if nbytes != numel * DTYPES[dtype][1]:
        return None
    base = _HEADER.size + 2 * _SHAPE.size + _COUNTS.size
    axes = [_AXIS.unpack_from(mv, base + i * _AXIS.size) for i in range(count)]
    for a in axes:
        if not 0 <= a[0] <= 4 or a[3] <= 0 or not 0 <= a[2] < a[3] or not -1 <= a[4] < ndim:
            return None
    return TensorMeta(dtype, tuple(g[:ndim]), tuple(loc[:ndim]), nbytes, kind, axes, off)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _as_tensor(mv: memoryview, meta: TensorMeta) -> Any:
    """A tensor over ``mv``'s data bytes (shares its memory, as Mooncake's
    ``buffer_to_tensor`` does over a user buffer)."""
    torch = _torch()
    dt = getattr(torch, DTYPES[meta.dtype][0])
    if meta.data_bytes == 0:
        return torch.empty(meta.local_shape, dtype=dt)
    data = mv[meta.data_offset:meta.data_offset + meta.data_bytes]
    return torch.frombuffer(data, dtype=torch.uint8).view(dt).reshape(meta.local_shape)


def decode(mv: memoryview) -> Any:
    """A tensor from a whole tensor object, or None."""
    meta = parse_meta(mv, len(mv))
    return None if meta is None else _as_tensor(mv, meta)


@dataclass
class _Info:
    """A tensor ready to write: its metadata and a byte view of its data (kept alive
    through ``owner``)."""

    meta: TensorMeta
    data: memoryview
    owner: Any

    def parts(self) -> tuple[bytes, memoryview]:
        return self.meta.pack(), self.data

    def joined(self) -> bytes:
        return self.meta.pack() + bytes(self.data)


def tensor_info(tensor: Any, require_contiguous: bool = False) -> _Info | None:
    """A torch tensor's FULL metadata and bytes (made contiguous and host-resident);
    None for anything Mooncake's ``extract_tensor_info`` refuses (not a tensor, an
    unknown dtype, more than 8 dims)."""
    if tensor is None or "Tensor" not in type(tensor).__name__:
        log.error("input is not a PyTorch tensor")
        return None
    try:
        if require_contiguous and not tensor.is_contiguous():
            return None
        t = tensor.contiguous()
        if getattr(t, "is_cuda", False) or getattr(t, "device", None) is not None \
                and str(t.device) != "cpu":
            t = t.cpu()
        code = dtype_code(t.dtype)
        if code < 0 or t.dim() > MAX_DIMS:
            log.error("unsupported tensor (dtype %s, %d dims)", t.dtype, t.dim())
            return None
        shape = tuple(int(d) for d in t.shape)
        nbytes = t.numel() * t.element_size()
        data = view(t.data_ptr(), nbytes) if nbytes else memoryview(b"")
    except Exception as exc:  # noqa: BLE001 - Mooncake logs and refuses
        log.error("cannot read tensor: %s", exc)
        return None
    return _Info(TensorMeta(code, shape, shape, nbytes), data, t)


# ------------------------------------------------- Mooncake's module helpers


def _serialize_tensor(tensor: Any) -> tuple[bytes, int, int, Any]:
    """``(metadata bytes, data pointer, data size, owner)`` of a tensor, as
    Mooncake's ``_serialize_tensor``; ValueError for a tensor it cannot store."""
    info = tensor_info(tensor)
    if info is None:
        raise ValueError("unsupported tensor for Mooncake tensor serialization")
    t = info.owner
    return info.meta.pack(), (t.data_ptr() if info.meta.data_bytes else 0), \
        info.meta.data_bytes, t


def _tensor_metadata_size() -> int:
    """304: the size of Mooncake's serialized tensor metadata."""
    return TENSOR_METADATA_SIZE


def _deserialize_tensor(payload: bytes) -> Any:
    """A tensor (owning a copy) from metadata plus payload bytes; ValueError if invalid."""
    t = decode(memoryview(bytearray(payload)))
    if t is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return t


# ---------------------------------------------------- parallelism requests


class ParallelAxis:
    """One axis of a shard's placement (Mooncake ``ParallelAxisSpec``): ``kind`` one of
    tp, dp, ep, pp (any case); ``rank`` of ``size``; ``split_dim`` (TP only),
    ``expert_id`` (EP), ``stage_id`` (PP): an int or None."""

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None

    def __repr__(self) -> str:
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim}, expert_id={self.expert_id}, "
                f"stage_id={self.stage_id})")


class TensorParallelism:
    """A shard's placement: ``axes``, a list of :class:`ParallelAxis`."""

    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []


class ReadTarget:
    """What a ``*_with_parallelism`` read returns: ``mode`` "as_stored" (the object at
    the key), "shard" (the shard ``parallelism`` names) or "full" (the whole tensor
    rebuilt from its shards); setting another mode raises RuntimeError."""

    def __init__(self) -> None:
        self._mode = "as_stored"
        self.parallelism: TensorParallelism | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        m = str(value).lower()
        if m not in ("as_stored", "shard", "full"):
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = m


#: A parsed axis: (kind code, rank, size, split_dim, expert_id, stage_id).
_Axis = tuple[int, int, int, Any, Any, Any]


def _parse_axes(p: Any) -> list[_Axis] | None:
    """A parallelism object's axes, validated as Mooncake's ``validate_parallelism_spec``
    does (known kinds once each, 0 <= rank < size, split_dim only and always on TP,
    expert_id on EP, stage_id on PP), or None."""
    try:
        axes = []
        for a in p.axes:
            kind = AXIS_KINDS.get(str(a.kind).lower())
            if kind is None:
                return None
            sd, eid, sid = (getattr(a, n, None) for n in ("split_dim", "expert_id", "stage_id"))
            axes.append((kind, int(a.rank), int(a.size), None if sd is None else int(sd),
                         None if eid is None else int(eid), None if sid is None else int(sid)))
    except (AttributeError, TypeError, ValueError):
        return None
    if not axes or len(axes) > MAX_AXES or len({a[0] for a in axes}) != len(axes):
        return None
    for kind, rank, size, sd, eid, sid in axes:
        if size <= 0 or not 0 <= rank < size:
            return None
        if (kind == 1) != (sd is not None) or (kind == 2 and eid is None) or \
                (kind == 3 and sid is None):
            return None
    return axes


def _canonical(axes: list[_Axis]) -> list[_Axis]:
    return sorted(axes, key=lambda a: a[0])


def _tp_index(axes: list[_Axis]) -> int | None:
    return next((i for i, a in enumerate(axes) if a[0] == 1), None)


def _with_tp_rank(axes: list[_Axis], rank: int) -> list[_Axis]:
    i = _tp_index(axes)
    out = list(axes)
    if i is not None:
        out[i] = (out[i][0], rank, *out[i][2:])
    return out


def tp_key(key: str, rank: int) -> str:
    """Mooncake's ``get_tp_key_name``: ``key_tp_<rank>``."""
    return f"{key}_tp_{rank}"


def parallelism_key(key: str, axes: list[_Axis]) -> str:
    """Mooncake's ``get_parallelism_key_name``: a single TP axis keeps the legacy
    ``key_tp_<rank>``; otherwise ``key__<kind>_<r>of<n>[_sd][_eid][_sid]`` per axis in
    dp, tp, ep, pp order."""
    if len(axes) == 1 and axes[0][0] == 1:
        return tp_key(key, axes[0][1])
    out = key
    for kind, rank, size, sd, eid, sid in _canonical(axes):
        out += f"__{_KIND_NAMES[kind]}_{rank}of{size}"
        if sd is not None:
            out += f"_sd{sd}"
        if eid is not None:
            out += f"_eid{eid}"
        if sid is not None:
            out += f"_sid{sid}"
    return out


def writer_shard_key(key: str, rank: int, size: int, split_dim: int) -> str:
    return f"{key}__writer_{rank}of{size}_sd{split_dim}"


def _layout_axes(axes: list[_Axis], local_shape: Sequence[int]) -> list[tuple[int, ...]] | None:
    out: list[tuple[int, ...]] = []
    for i, (kind, rank, size, sd, eid, sid) in enumerate(axes):
        if sd is not None and not 0 <= sd < len(local_shape):
            return None
        r0 = eid if kind == 2 and eid is not None else sid if kind == 3 and sid is not None \
            else 0
        out.append((kind, i, rank, size, -1 if sd is None else sd, r0,
                    -1 if sd is None else local_shape[sd]))
    return out


def _axes_of_meta(meta: TensorMeta) -> list[_Axis] | None:
    if meta.layout_kind != LAYOUT_SHARD:
        return None
    out = []
    for kind, _, rank, size, sd, r0, _ in meta.axes:
        out.append((kind, rank, size, None if sd < 0 else sd, r0 if kind == 2 else None,
                    r0 if kind == 3 else None))
    return _canonical(out)


def _matches(axes: list[_Axis], meta: TensorMeta) -> bool:
    return _axes_of_meta(meta) == _canonical(axes)


def _uniform(shape: Sequence[int], split_dim: int, count: int) -> bool:
    return 0 <= split_dim < len(shape) and count > 0 and shape[split_dim] % count == 0


def _manifest(dtype: int, global_shape: Sequence[int], split_dim: int, count: int) -> bytes:
    g = list(global_shape) + [-1] * (MAX_DIMS - len(global_shape))
    return _MANIFEST.pack(MANIFEST_MAGIC, MANIFEST_VERSION, MANIFEST_SIZE, dtype,
                          len(global_shape), split_dim, count, 0) + _SHAPE.pack(*g)


def _parse_manifest(buf: bytes) -> tuple[int, tuple[int, ...], int, int] | None:
    """``(dtype, global shape, split_dim, shard count)`` of a manifest, or None."""
    if len(buf) < MANIFEST_SIZE:
        return None
    magic, ver, hsize, dtype, ndim, sd, count, _ = _MANIFEST.unpack_from(buf, 0)
    if magic != MANIFEST_MAGIC or ver != MANIFEST_VERSION or hsize != MANIFEST_SIZE or \
            not 0 <= ndim <= MAX_DIMS or count <= 0 or not 0 <= sd < ndim:
        return None
    shape = _SHAPE.unpack_from(buf, _MANIFEST.size)[:ndim]
    if any(d < 0 for d in shape):
        return None
    return dtype, tuple(shape), sd, count


def _writer_of(obj: Any) -> tuple[int, int, int] | None:
    """``(rank, size, split_dim)`` of a writer_partition object (any object with those
    attributes), or None when invalid."""
    try:
        r, n, sd = int(obj.rank), int(obj.size), int(obj.split_dim)
    except (AttributeError, TypeError, ValueError):
        return None
    return (r, n, sd) if n > 0 and 0 <= r < n and sd >= 0 else None


def _shard_range(dim: int, rank: int, count: int) -> tuple[int, int]:
    start = dim * rank // count
    return start, dim * (rank + 1) // count - start


def _narrow(info: _Info, split_dim: int, rank: int, count: int, axes: list[_Axis],
            global_shape: Sequence[int] | None = None) -> _Info | None:
    """The SHARD object of ``rank`` of ``count`` along ``split_dim`` of a full tensor's
    ``info`` (uniform splits only), its metadata carrying ``axes``."""
    shape = info.meta.local_shape
    if not _uniform(shape, split_dim, count) or not 0 <= rank < count:
        return None
    start, n = _shard_range(shape[split_dim], rank, count)
    shard = tensor_info(_as_full_tensor(info).narrow(split_dim, start, n))
    if shard is None:
        return None
    return _shard_info(shard, global_shape or shape, axes)


def _as_full_tensor(info: _Info) -> Any:
    t = info.owner
    return t.reshape(info.meta.local_shape)


def _shard_info(shard: _Info, global_shape: Sequence[int], axes: list[_Axis]) -> _Info | None:
    layout = _layout_axes(axes, shard.meta.local_shape)
    if layout is None or len(global_shape) != len(shard.meta.local_shape):
        return None
    m = shard.meta
    return _Info(TensorMeta(m.dtype, tuple(global_shape), m.local_shape, m.data_bytes,
                            LAYOUT_SHARD, layout), shard.data, shard.owner)


def _tp(rank: int, size: int, split_dim: int) -> list[_Axis]:
    return [(1, rank, size, split_dim, None, None)]


class TensorOps(Facade):
    """Mooncake's tensor calls over the object calls of the native client."""

    # ---------------------------------------------------------- primitives

    def _write(self, key: str, info: _Info | None, config: ReplicateConfig | None,
               upsert: bool = False) -> int:
        if info is None:
            return INVALID
        try:
            if upsert:
                self.client.upsert_parts(key, *info.parts(), config=config)
            else:
                self.client.put_parts(key, *info.parts(), config=config)
            return 0
        except Exception as exc:  # noqa: BLE001 - Mooncake reports failures as codes
            return code_of(exc)

    def _write_many(self, keys: Sequence[str], infos: Sequence[_Info | None],
                    config: ReplicateConfig | None, upsert: bool = False) -> list[int]:
        out = [INVALID] * len(keys)
        pos = [i for i, info in enumerate(infos) if info is not None]
        if not pos:
            return out
        try:
            if upsert:
                got = self.client.upsert_batch(
                    [keys[i] for i in pos], [infos[i].joined() for i in pos],  # type: ignore
                    config)
            else:  # metadata and data copied once into the segment, not joined first
                got = self.client.batch_put_from_parts(
                    [keys[i] for i in pos], [infos[i].parts() for i in pos],  # type: ignore
                    config)
        except Exception as exc:  # noqa: BLE001
            got = [code_of(exc)] * len(pos)
        for i, r in zip(pos, got):
            out[i] = int(r)
        return out

    def _raw(self, key: str) -> memoryview | None:
        try:
            return memoryview(self.client.get_buffer(key))
        except Exception:  # noqa: BLE001 - a miss reads as None
            return None

    def _load(self, key: str) -> tuple[memoryview, TensorMeta] | None:
        mv = self._raw(key)
        if mv is None:
            return None
        meta = parse_meta(mv, len(mv))
        return None if meta is None else (mv, meta)

    def _bad_batch(self, keys: Sequence[str], *others: Sequence[Any]) -> bool:
        return len(keys) > MAX_BATCH or any(len(o) != len(keys) for o in others)

    # --------------------------------------------------------------- reads

    def get_tensor(self, key: str) -> Any:
        """The tensor stored at ``key`` (a private copy), or None."""
        got = self._load(key)
        return None if got is None else _as_tensor(*got)

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """One tensor or None per key."""
        if len(keys) > MAX_BATCH:
            return [None] * len(keys)
        try:
            bufs = self.client.get_batch(keys)
        except Exception:  # noqa: BLE001
            return [None] * len(keys)
        return [None if b is None else decode(memoryview(bytearray(b))) for b in bufs]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read the object into ``size`` bytes at ``buffer_ptr`` and return a tensor over
        that buffer's data bytes (writes to it change the buffer), or None."""
        if not buffer_ptr:
            return None
        try:
            n = self.client.get_into(key, view(buffer_ptr, size))
        except Exception:  # noqa: BLE001
            return None
        return decode(view(buffer_ptr, n))

    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list[int],
                              sizes: list[int]) -> list[Any]:
        """A tensor (over its buffer) or None per key; INVALID_PARAMS at every position
        when the lists differ in length or a pointer is null."""
        if self._bad_batch(keys, buffer_ptrs, sizes) or not all(buffer_ptrs):
            return [INVALID] * len(keys)
        try:
            got = self.client.batch_get_into(
                keys, [view(p, s) for p, s in zip(buffer_ptrs, sizes)])
        except Exception:  # noqa: BLE001
            return [None] * len(keys)
        return [decode(view(p, n)) if n >= 0 else None for p, n in zip(buffer_ptrs, got)]

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Needs a CUDA device: refused with INVALID_PARAMS without one."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Copy each object's tensor payload into a pre-allocated CUDA tensor of the same
        dtype and shape; bytes copied or a negative code per key.  Without a CUDA
        device every position is INVALID_PARAMS (one error logged)."""
        torch = _torch()
        if self._bad_batch(keys, tensors_list):
            return [INVALID] * len(keys)
        if not torch.cuda.is_available():
            log.error("batch_get_tensor_into_cuda: no CUDA device on this host")
            return [INVALID] * len(keys)
        out = []
        for key, dst in zip(keys, tensors_list):
            src = self.get_tensor(key)
            if src is None or not getattr(dst, "is_cuda", False) or dst.dtype != src.dtype \
                    or tuple(dst.shape) != tuple(src.shape) or not dst.is_contiguous():
                out.append(INVALID)
                continue
            dst.copy_(src)
            out.append(src.numel() * src.element_size())
        return out

    # -------------------------------------------------------------- writes

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self._write(key, tensor_info(tensor), None)

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self._write(key, tensor_info(tensor), config)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._write(key, tensor_info(tensor), None, upsert=True)

    def upsert_pub_tensor(self, key: str, tensor: Any,
                          config: ReplicateConfig | None = None) -> int:
        return self._write(key, tensor_info(tensor), config, upsert=True)

    def _batch_tensors(self, keys: list[str], tensors: list[Any],
                       config: ReplicateConfig | None, upsert: bool) -> list[int]:
        if not keys or self._bad_batch(keys, tensors):
            return [INVALID] * len(keys)
        return self._write_many(keys, [tensor_info(t) for t in tensors], config, upsert)

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._batch_tensors(keys, tensors_list, None, False)

    def batch_pub_tensor(self, keys: list[str], tensors_list: list[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        return self._batch_tensors(keys, tensors_list, config, False)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._batch_tensors(keys, tensors_list, None, True)

    def batch_upsert_pub_tensor(self, keys: list[str], tensors_list: list[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        return self._batch_tensors(keys, tensors_list, config, True)

    def _from(self, key: str, ptr: int, size: int, config: ReplicateConfig | None,
              upsert: bool) -> int:
        """Write a ``[TensorMetadata][data]`` buffer as it is, after checking its layout."""
        if not ptr or size < TENSOR_METADATA_SIZE or bad_buffer(ptr, size) \
                or parse_meta(view(ptr, size), size) is None:
            return INVALID
        try:
            (self.client.upsert_from if upsert else self.client.put_from)(
                key, view(ptr, size), config)
            return 0
        except Exception as exc:  # noqa: BLE001
            return code_of(exc)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store a buffer laid out ``[TensorMetadata][tensor data]`` (as ``get_tensor_into``
        leaves it); INVALID_PARAMS when its metadata does not validate."""
        return self._from(key, buffer_ptr, size, None, False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._from(key, buffer_ptr, size, None, True)

    def _batch_from(self, keys: list[str], ptrs: list[int], sizes: list[int],
                    upsert: bool) -> list[int]:
        """As Mooncake's ``batch_put_tensor_from``: one invalid buffer (null, too small,
        metadata that does not validate) fails every position; otherwise one batch."""
        if not keys:
            return []
        if self._bad_batch(keys, ptrs, sizes) or not all(
                p and s >= TENSOR_METADATA_SIZE and not bad_buffer(p, s)
                and parse_meta(view(p, s), s) is not None
                for p, s in zip(ptrs, sizes)):
            return [INVALID] * len(keys)
        views = [view(p, s) for p, s in zip(ptrs, sizes)]
        try:
            if upsert:
                return [int(r) for r in self.client.upsert_batch(keys, views, None)]
            return [int(r) for r in self.client.batch_put_from(keys, views, None)]
        except Exception as exc:  # noqa: BLE001
            return [code_of(exc)] * len(keys)

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int],
                              sizes: list[int]) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int],
                                 sizes: list[int]) -> list[int]:
        return self._batch_from(keys, buffer_ptrs, sizes, True)

    # ------------------------------------------------------------ with_tp

    def _tp_infos(self, tensor: Any, size: int, split_dim: int,
                  axes: list[_Axis] | None = None) -> list[_Info] | None:
        """Every rank's shard of a full tensor (Mooncake ``build_tp_shard_infos``)."""
        info = tensor_info(tensor)
        if info is None or not _uniform(info.meta.local_shape, split_dim, size):
            return None
        out = []
        for r in range(size):
            shard = _narrow(info, split_dim, r, size,
                            _with_tp_rank(axes, r) if axes else _tp(r, size, split_dim))
            if shard is None:
                return None
            out.append(shard)
        return out

    def _put_tp(self, key: str, tensor: Any, config: ReplicateConfig | None, size: int,
                split_dim: int, upsert: bool = False) -> int:
        infos = self._tp_infos(tensor, size, split_dim)
        if infos is None:
            return INVALID
        return self._first_error(self._write_many(
            [tp_key(key, r) for r in range(size)], infos, config, upsert))

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Split ``tensor`` into ``tp_size`` uniform shards along ``split_dim`` and store
        all of them as ``key_tp_<rank>`` (``tp_size`` <= 1: a plain put_tensor)."""
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        return self._put_tp(key, tensor, None, tp_size, split_dim)

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._put_tp(key, tensor, config, tp_size, split_dim)

    def _batch_tp(self, keys: list[str], tensors: list[Any], config: ReplicateConfig | None,
                  tp_size: int, split_dim: int) -> list[int]:
        if not keys or self._bad_batch(keys, tensors):
            return [INVALID] * len(keys)
        return [self._put_tp(k, t, config, tp_size, split_dim) for k, t in zip(keys, tensors)]

    def batch_put_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any],
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list)
        return self._batch_tp(base_keys, tensors_list, None, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: list[str], tensors_list: list[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        return self._batch_tp(base_keys, tensors_list, config, tp_size, split_dim)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        """The shard ``key_tp_<tp_rank>`` (``tp_size`` <= 1: the tensor at ``key``)."""
        return self.get_tensor(key if tp_size <= 1 else tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any]:
        if tp_size <= 1:
            return self.batch_get_tensor(base_keys)
        return self.batch_get_tensor([tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        return self.get_tensor_into(key if tp_size <= 1 else tp_key(key, tp_rank),
                                    buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: list[str], buffer_ptrs: list[int],
                                      sizes: list[int], tp_rank: int = 0,
                                      tp_size: int = 1) -> list[Any]:
        keys = base_keys if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def _decode_at(self, ptr: int, size: int) -> Any:
        return decode(view(ptr, size)) if ptr and size >= TENSOR_METADATA_SIZE \
            and not bad_buffer(ptr, size) else None

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """Split a full ``[TensorMetadata][data]`` buffer and store every rank's shard
        as ``key_tp_<rank>`` (``tp_size`` <= 1: ``put_tensor_from``)."""
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        t = self._decode_at(buffer_ptr, size)
        return INVALID if t is None else self._put_tp(key, t, None, tp_size, split_dim)

    def batch_put_tensor_with_tp_from(self, base_keys: list[str], buffer_ptrs: list[int],
                                      sizes: list[int], tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        if self._bad_batch(base_keys, buffer_ptrs, sizes):
            return [INVALID] * len(base_keys)
        return [self.put_tensor_with_tp_from(k, p, s, tp_rank, tp_size, split_dim)
                for k, p, s in zip(base_keys, buffer_ptrs, sizes)]
