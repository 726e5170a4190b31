"""``EngramStore``: embedding tables kept as objects of a store, as Mooncake's
``mooncake.store.EngramStore`` (``mooncake-integration/store/engram_store_py.cpp``;
``mooncake-store/src/engram/engram_store.cpp``, ``EngramStore::populate``,
``lookup_rows_flat``, ``remove_from_store``).

A layer's table of head ``h`` is one object, key ``engram:l<layer_id>:h<h>``: the
float32 rows ``[vocab_size_h, embedding_dim]`` in row-major order.  ``populate``
writes every head's table (``batch_put_from``; refused when a key already exists);
``lookup(row_ids)`` reads rows ``row_ids[b][l][h]`` of head ``h`` into a new float32
array ``[B, L, H, D]`` with ranged reads (``get_into_ranges``, in rounds of at most
the facade's ``MAX_RANGES`` rows; a head's table small next to the rows asked for is
read whole with ``get_into`` instead, for the same result); ``remove_from_store``
removes the tables.  Failures raise as Mooncake's binding does: ``ValueError`` for a
bad config, ``RuntimeError`` with Mooncake's messages otherwise.  Needs numpy (the
arrays are numpy's, as in Mooncake).
"""

from __future__ import annotations

import operator
from typing import Any

from kvmaster.compat._ranges import MAX_RANGES
from kvmaster.protocol import Status

#: The most rows (B * L * H) one ``lookup`` reads.
MAX_LOOKUP_ROWS = 1 << 22
#: The most heads (tables) of one layer.
MAX_HEADS = 1 << 12
#: A head's table at most this large is read whole for a lookup (see
#: ``EngramStore._whole_table``).
WHOLE_TABLE_MAX = 64 << 20

_NOT_FOUND = int(Status.OBJECT_NOT_FOUND)
_INVALID = int(Status.INVALID_PARAMS)


def _np() -> Any:
    import numpy

    return numpy


class EngramStoreConfig:
    """A layer's table layout (Mooncake's ``EngramStoreConfig``): ``table_vocab_sizes``
    (rows of each head's table; default ``[1024]``; reading it gives a copy, as
    pybind11's) and ``embedding_dim`` (floats per row; default 64)."""

    def __init__(self) -> None:
        self._vocab: list[int] = [1024]
        self._dim = 64

    @property
    def table_vocab_sizes(self) -> list[int]:
        return list(self._vocab)

    @table_vocab_sizes.setter
    def table_vocab_sizes(self, value: Any) -> None:
        if isinstance(value, (str, bytes)):
            raise TypeError("table_vocab_sizes must be a list of integers")
        try:
            self._vocab = [operator.index(v) for v in value]
        except TypeError:
            raise TypeError("table_vocab_sizes must be a list of integers") from None

    @property
    def embedding_dim(self) -> int:
        return self._dim

    @embedding_dim.setter
    def embedding_dim(self, value: Any) -> None:
        self._dim = operator.index(value)


class EngramStore:
    """One layer's embedding tables in ``store`` (a set-up
    :class:`~kvmaster.compat.MooncakeDistributedStore`; None: every call fails, as
    Mooncake's with no store).  ``ValueError`` for an empty ``table_vocab_sizes``, a
    size or ``embedding_dim`` that is not positive (or more than :data:`MAX_HEADS`
    heads)."""

    def __init__(self, layer_id: int, config: EngramStoreConfig, store: Any = None) -> None:
        layer_id = operator.index(layer_id)
        if not isinstance(config, EngramStoreConfig):
            raise TypeError("config must be an EngramStoreConfig")
        vocab, dim = config.table_vocab_sizes, config.embedding_dim
        if not vocab:
            raise ValueError("EngramStoreConfig.table_vocab_sizes must not be empty")
        if dim <= 0:
            raise ValueError("EngramStoreConfig.embedding_dim must be positive")
        if any(v <= 0 for v in vocab):
            raise ValueError("EngramStoreConfig.table_vocab_sizes must contain only "
                             "positive values")
        if len(vocab) > MAX_HEADS:
            raise ValueError(f"EngramStoreConfig.table_vocab_sizes has more than "
                             f"{MAX_HEADS} heads")
        if store is not None and not all(callable(getattr(store, m, None)) for m in (
                "batch_put_from", "get_into_ranges", "register_buffer", "unregister_buffer",
                "batch_is_exist", "remove")):
            raise RuntimeError("EngramStore store parameter must be a "
                               "MooncakeDistributedStore")
        self._store = store
        self._vocab = vocab
        self._dim = dim
        self._keys = [f"engram:l{layer_id}:h{h}" for h in range(len(vocab))]

    def get_table_vocab_sizes(self) -> list[int]:
        return list(self._vocab)

    def get_store_keys(self) -> list[str]:
        return list(self._keys)

    def get_num_heads(self) -> int:
        return len(self._vocab)

    def get_embedding_dim(self) -> int:
        return self._dim

    # ------------------------------------------------------------------ writes

    def populate(self, embedding_buffers: list) -> None:
        """Store each head's table: ``embedding_buffers[h]`` a numpy array
        ``[vocab_size_h, embedding_dim]`` (converted to C-contiguous float32).
        ``RuntimeError("populate failed")`` when a key exists already (remove the
        layer first), the store fails (the heads written are removed again), or there
        is no store; other messages for a list or array of the wrong length, type or
        shape."""
        np = _np()
        if not isinstance(embedding_buffers, list):
            raise TypeError("embedding_buffers must be a list")
        if len(embedding_buffers) != len(self._vocab):
            raise RuntimeError("embedding_buffers size must match num_heads")
        arrays = []
        for h, buf in enumerate(embedding_buffers):
            if not isinstance(buf, np.ndarray):
                raise RuntimeError("embedding_buffers must be NumPy arrays")
            try:
                arr = np.ascontiguousarray(buf, dtype=np.float32)
            except (TypeError, ValueError):
                raise RuntimeError("embedding_buffers must be float32 arrays") from None
            if arr.ndim != 2:
                raise RuntimeError("each embedding buffer must be 2D [N_h, D]")
            if arr.shape != (self._vocab[h], self._dim):
                raise RuntimeError("embedding buffer shape does not match "
                                   "get_table_vocab_sizes()/get_embedding_dim()")
            arrays.append(arr)
        if self._populate(arrays) != 0:
            raise RuntimeError("populate failed")

    def _populate(self, arrays: list) -> int:
        s = self._store
        if s is None:
            return -1
        exists = s.batch_is_exist(self._keys)
        if len(exists) != len(self._keys) or any(e != 0 for e in exists):
            return -1  # a failed query, or a table there already
        ptrs = [a.ctypes.data for a in arrays]
        sizes = [a.nbytes for a in arrays]
        registered = []
        ok = True
        for p, n in zip(ptrs, sizes):
            if s.register_buffer(p, n) != 0:
                ok = False
                break
            registered.append(p)
        put = s.batch_put_from(self._keys, ptrs, sizes) if ok else []
        for p in registered:
            ok &= s.unregister_buffer(p) == 0
        if ok and len(put) == len(self._keys) and all(r == 0 for r in put):
            return 0
        for i, key in enumerate(self._keys):  # roll back what was written
            if len(put) != len(self._keys) or put[i] == 0:
                s.remove(key, True)
        return -1

    # ------------------------------------------------------------------- reads

    def lookup(self, row_ids: Any):  # noqa: ANN201 - numpy.ndarray (numpy is optional)
        """Rows ``row_ids[b][l][h]`` of head ``h``'s table -> float32 array
        ``[B, L, H, D]``.  ``row_ids``: a numpy array ``[B, L, H]`` (converted to
        int64) or nested lists of that shape.  ``RuntimeError("EngramStore lookup
        failed")`` for a row outside its table, ragged lists, an empty batch, a table
        not in the store, no store, or more than :data:`MAX_LOOKUP_ROWS` rows;
        ``"row_ids must not be empty"`` for empty lists; ``"row_ids array must have
        shape [B, L, H]"`` / ``"row_ids last dimension must match num_heads"`` for an
        array of another shape."""
        np = _np()
        H = len(self._vocab)
        if isinstance(row_ids, np.ndarray):
            try:
                ids = np.ascontiguousarray(row_ids, dtype=np.int64)
            except (TypeError, ValueError):
                raise RuntimeError("row_ids array must be convertible to int64") from None
            if ids.ndim != 3:
                raise RuntimeError("row_ids array must have shape [B, L, H]")
            if ids.shape[2] != H:
                raise RuntimeError("row_ids last dimension must match num_heads")
        else:
            rows = [[list(t) for t in b] for b in row_ids]
            if not rows or not rows[0]:
                raise RuntimeError("row_ids must not be empty")
            L = len(rows[0])
            if any(len(b) != L or any(len(t) != H for t in b) for b in rows):
                raise RuntimeError("EngramStore lookup failed")
            try:
                ids = np.array(rows, dtype=np.int64).reshape(len(rows), L, H)
            except (TypeError, ValueError, OverflowError):
                raise TypeError("row_ids must hold integers") from None
        B, L = int(ids.shape[0]), int(ids.shape[1])
        out = np.zeros((B, L, H, self._dim), dtype=np.float32)
        if self._lookup(ids, out) != 0:
            out[...] = 0
            raise RuntimeError("EngramStore lookup failed")
        return out

    def _lookup(self, ids: Any, out: Any) -> int:
        np = _np()
        s = self._store
        B, L, H = ids.shape
        if s is None or B <= 0 or L <= 0 or B * L * H > MAX_LOOKUP_ROWS:
            return -1
        if ((ids < 0) | (ids >= np.asarray(self._vocab, dtype=np.int64))).any():
            return -1
        row = self._dim * 4
        ranged = [h for h in range(H) if not self._whole_table(h, ids, out)]
        if not ranged:
            return 0
        flat = ids.reshape(-1)
        heads = np.tile(np.arange(H), flat.size // H)
        pick = np.isin(heads, ranged)
        dst = np.flatnonzero(pick).astype(np.int64) * row  # out is [B, L, H, D] row-major
        src, heads = flat[pick] * row, heads[pick]
        n = heads.size
        ptr = out.ctypes.data
        if s.register_buffer(ptr, out.nbytes) != 0:
            return -1
        try:
            for lo in range(0, n, MAX_RANGES):
                hi = min(n, lo + MAX_RANGES)
                order = np.argsort(heads[lo:hi], kind="stable")
                hs = heads[lo:hi][order]
                d_part, s_part = dst[lo:hi][order], src[lo:hi][order]
                uniq, starts = np.unique(hs, return_index=True)
                ends = list(starts[1:]) + [len(hs)]
                keys = [self._keys[int(h)] for h in uniq]
                dsts = [d_part[a:b].tolist() for a, b in zip(starts, ends)]
                srcs = [s_part[a:b].tolist() for a, b in zip(starts, ends)]
                sizes = [[row] * (b - a) for a, b in zip(starts, ends)]
                got = s.get_into_ranges([ptr], [keys], [dsts], [srcs], [sizes])
                if len(got) != 1 or len(got[0]) != len(keys) or any(
                        len(g) != len(z) or any(r != row for r in g)
                        for g, z in zip(got[0], sizes)):
                    return -1
        finally:
            if s.unregister_buffer(ptr) != 0:
                return -1  # noqa: B012 - Mooncake fails the lookup on this too
        return 0

    def _whole_table(self, h: int, ids: Any, out: Any) -> bool:
        """Fill head ``h`` of ``out`` from one read of its whole table when that is
        small (at most :data:`WHOLE_TABLE_MAX` bytes, and at most 8 rows per row
        asked for): one copy instead of a ranged read per row, with the same
        result.  False when not done (the rows are then read as ranges)."""
        np = _np()
        vocab, tokens = self._vocab[h], ids.shape[0] * ids.shape[1]
        if vocab * self._dim * 4 > WHOLE_TABLE_MAX or vocab > 8 * tokens:
            return False
        table = np.empty((vocab, self._dim), dtype=np.float32)
        if self._store.get_into(self._keys[h], table.ctypes.data, table.nbytes) != table.nbytes:
            return False  # missing, or not this table's size: the ranged read decides
        out[:, :, h, :] = table[ids[:, :, h]]
        return True

    # ------------------------------------------------------------------ removal

    def remove_from_store(self, force: bool = False) -> int:
        """Remove this layer's tables -> how many were removed (missing ones are
        skipped); ``RuntimeError("remove_from_store failed, rc=<code>")`` for the
        first other failure, or with no store (INVALID_PARAMS, -600)."""
        s = self._store
        if s is None:
            raise RuntimeError(f"remove_from_store failed, rc={_INVALID}")
        removed, first = 0, 0
        for key in self._keys:
            rc = s.remove(key, bool(force))
            if rc == 0:
                removed += 1
            elif rc != _NOT_FOUND and first == 0:
                first = rc
        if first < 0:
            raise RuntimeError(f"remove_from_store failed, rc={first}")
        return removed
