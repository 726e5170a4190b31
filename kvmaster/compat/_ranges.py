"""Byte-range and multi-part calls of the facade (Mooncake
``mooncake-integration/store/store_py.cpp``: ``get_into_ranges``, ``upsert_parts``,
``put_from_with_metadata``; ``mooncake-store/src/real_client.cpp``:
``RealClient::get_into_ranges_internal``, ``upsert_parts``,
``put_from_with_metadata``)."""

from __future__ import annotations

from typing import Any

from kvmaster.compat._common import Facade, bad_buffer, code_of, view
from kvmaster.compat._config import ReplicateConfig
from kvmaster.protocol import Status

INVALID = int(Status.INVALID_PARAMS)
#: Most buffers, and most ranges over all buffers, in one ``get_into_ranges`` call.
MAX_BUFFERS = 1 << 12
MAX_RANGES = 1 << 16
#: Keys leased in one round (below the master's ``--max-batch``, 4096 by default).
LEASE_BATCH = 1024


def _bytes_part(obj: Any) -> memoryview:
    """A 1-D byte view of a bytes-like part; TypeError for anything else, as Mooncake
    raises for a part that is not 1-D bytes-like."""
    mv = memoryview(obj)
    if mv.ndim != 1 or mv.itemsize != 1:
        raise TypeError("parts must be 1-D bytes-like")
    return mv.cast("B") if mv.format != "B" else mv


class RangeOps(Facade):
    """Reads of byte ranges into registered buffers and writes of a value in parts."""

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]],
                        all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """Buffer-major ranged reads: for buffer ``i`` and its key ``j``, range ``k``
        copies ``all_sizes[i][j][k]`` bytes of the object from
        ``all_src_offsets[i][j][k]`` to ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``.

        Returns ``results[i][j][k]``: the bytes copied or a negative code, shaped like
        ``all_dst_offsets``.  As in Mooncake: a buffer must be registered
        (``register_buffer``) and a range must fit in what is registered from its
        pointer on; lists of different lengths at any level, a range past the object
        or the buffer, and an unregistered buffer leave INVALID_PARAMS (-600) at their
        positions; a missing object gives OBJECT_NOT_FOUND (-704) at each of its
        ranges, a copy that outlasts its read lease LEASE_EXPIRED.  The keys are
        leased in rounds of up to :data:`LEASE_BATCH`, each followed by its copies."""
        out = [[[INVALID] * len(offs) for offs in groups] for groups in all_dst_offsets]
        n = len(buffer_ptrs)
        if n > MAX_BUFFERS or not n == len(all_keys) == len(all_dst_offsets) \
                == len(all_src_offsets) == len(all_sizes):
            return out
        if sum(len(r) for groups in all_dst_offsets for r in groups) > MAX_RANGES:
            return out
        # every range that fits its registered buffer, as one (offset, view) group
        index: dict[str, int] = {}
        where: list[tuple[int, int, int]] = []
        positions: list[int] = []
        ranges: list[list[tuple[int, Any]]] = []
        for i, ptr in enumerate(buffer_ptrs):
            cap = self._registered_capacity(ptr) if ptr else 0
            keys = all_keys[i]
            dsts, srcs, sizes = all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
            if not cap or not len(keys) == len(dsts) == len(srcs) == len(sizes):
                continue
            for j, key in enumerate(keys):
                d, src, z = dsts[j], srcs[j], sizes[j]
                if not len(d) == len(src) == len(z):
                    continue
                for k in range(len(d)):
                    if not 0 <= d[k] <= cap or not 0 <= z[k] <= cap - d[k]:
                        continue  # past the registered buffer: INVALID_PARAMS stays
                    where.append((i, j, k))
                    positions.append(index.setdefault(key, len(index)))
                    ranges.append([(src[k], view(ptr + d[k], z[k]))])
        keys_in_order = list(index)
        for first in range(0, len(keys_in_order), LEASE_BATCH):
            mine = [r for r, p in enumerate(positions) if first <= p < first + LEASE_BATCH]
            try:
                leases = self.client.batch_get_leases(keys_in_order[first:first + LEASE_BATCH])
                got = self.client.batch_read_ranges(
                    leases, [positions[r] - first for r in mine], [ranges[r] for r in mine])
            except Exception as exc:  # noqa: BLE001 - Mooncake reports codes per range
                got = [code_of(exc)] * len(mine)
            for r, code in zip(mine, got):
                i, j, k = where[r]
                out[i][j][k] = int(code)
        return out

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``buffer_ptr`` (the next family's call), and note
        the region: ranged reads write only into registered memory, as Mooncake's."""
        rc = super().register_buffer(buffer_ptr, size)  # type: ignore[misc]
        if rc == 0 and buffer_ptr and size > 0:
            self.__dict__.setdefault("_range_regions", {})[int(buffer_ptr)] = int(size)
        return rc

    def unregister_buffer(self, buffer_ptr: int) -> int:
        self.__dict__.get("_range_regions", {}).pop(int(buffer_ptr), None)
        return super().unregister_buffer(buffer_ptr)  # type: ignore[misc]

    def _registered_capacity(self, ptr: int) -> int:
        """Bytes registered from ``ptr`` to the end of its registered region; 0 when
        ``ptr`` lies in none."""
        for start, size in list(self.__dict__.get("_range_regions", {}).items()):
            if start <= ptr < start + size:
                return start + size - ptr
        return 0

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the parts, joined in order, as one object (insert or replace); 0 or a
        negative code.  A part that is not 1-D bytes-like raises TypeError."""
        views = [_bytes_part(p) for p in parts]
        if not views:
            return INVALID
        return self._run("upsert_parts", key, *views, config=config)

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int,
                               config: ReplicateConfig | None = None) -> int:
        """Store ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size``
        bytes at ``buffer_ptr`` as one object (Mooncake ``put_from_with_metadata``:
        the metadata first); 0 or a negative code.  ``size`` 0 stores nothing (the
        metadata neither) and answers 0, as Mooncake's "empty data" case."""
        if size == 0 and self._client is not None:
            return 0
        if not buffer_ptr or bad_buffer(buffer_ptr, size) or \
                bad_buffer(metadata_buffer_ptr, metadata_size):
            return INVALID
        parts = [view(metadata_buffer_ptr, metadata_size)] if metadata_size else []
        parts.append(view(buffer_ptr, size))
        return self._run("put_parts", key, *parts, config=config)
