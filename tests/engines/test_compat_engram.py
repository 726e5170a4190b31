"""kvmaster.compat.EngramStore (Mooncake's ``mooncake.store.EngramStore``): a layer's
embedding tables as objects of the store, against a real master."""

from __future__ import annotations

import numpy as np
import pytest

from kvmaster.compat import EngramStore, EngramStoreConfig
from kvmaster.compat._ranges import MAX_RANGES

MiB = 1 << 20


@pytest.fixture
def store(make_store):
    return make_store(32 * MiB, 4 * MiB)


def _layer(store, vocab=(50, 70, 30), dim=8, layer=3):
    cfg = EngramStoreConfig()
    cfg.table_vocab_sizes = list(vocab)
    cfg.embedding_dim = dim
    rng = np.random.default_rng(layer)
    tables = [rng.standard_normal((v, dim)).astype(np.float32) for v in vocab]
    return EngramStore(layer, cfg, store), tables


def test_config_defaults_and_keys(store) -> None:
    cfg = EngramStoreConfig()
    assert cfg.table_vocab_sizes == [1024] and cfg.embedding_dim == 64
    cfg.table_vocab_sizes.append(5)  # a copy, as pybind11's
    assert cfg.table_vocab_sizes == [1024]
    es, _ = _layer(store)
    assert es.get_store_keys() == ["engram:l3:h0", "engram:l3:h1", "engram:l3:h2"]
    assert es.get_num_heads() == 3 and es.get_embedding_dim() == 8
    assert es.get_table_vocab_sizes() == [50, 70, 30]


def test_populate_lookup_and_remove(store) -> None:
    es, tables = _layer(store)
    es.populate(tables)
    assert store.get_size("engram:l3:h1") == 70 * 8 * 4
    ids = np.array([[[0, 69, 29], [49, 1, 0]], [[7, 7, 7], [3, 60, 10]]])
    out = es.lookup(ids)
    assert out.shape == (2, 2, 3, 8) and out.dtype == np.float32
    for b in range(2):
        for t in range(2):
            for h in range(3):
                np.testing.assert_array_equal(out[b, t, h], tables[h][ids[b, t, h]])
    np.testing.assert_array_equal(es.lookup(ids.tolist()), out)  # nested lists too
    with pytest.raises(RuntimeError, match="populate failed"):
        es.populate(tables)  # the tables are there already
    # the lookups' read leases still hold the tables: force, as in Mooncake
    assert es.remove_from_store(force=True) == 3
    assert es.remove_from_store() == 0  # missing tables are skipped
    with pytest.raises(RuntimeError, match="lookup failed"):
        es.lookup(ids)


@pytest.mark.parametrize("vocab", [256, 300_000], ids=["whole-tables", "ranges"])
def test_a_lookup_larger_than_one_round_of_ranges(store, vocab) -> None:
    es, tables = _layer(store, vocab=(vocab, vocab), dim=4, layer=0)
    es.populate(tables)
    n = MAX_RANGES // 2 + 10  # tokens: 2 heads each, more than one round of ranges
    assert (vocab > 8 * n) == (vocab == 300_000)  # read as ranges, not whole
    ids = np.random.default_rng(1).integers(0, vocab, size=(1, n, 2))
    out = es.lookup(ids)
    np.testing.assert_array_equal(out[0, :, 0], tables[0][ids[0, :, 0]])
    np.testing.assert_array_equal(out[0, :, 1], tables[1][ids[0, :, 1]])
    assert es.remove_from_store(force=True) == 2


def test_bad_input_raises_as_mooncakes_binding(store) -> None:
    es, tables = _layer(store)
    for bad, msg in ((tables[:2], "size must match num_heads"),
                     ([t.tolist() for t in tables], "must be NumPy arrays"),
                     ([tables[0], tables[1], tables[2][:5]], "shape does not match"),
                     ([tables[0], tables[1], tables[2].reshape(-1)], "must be 2D")):
        with pytest.raises(RuntimeError, match=msg):
            es.populate(bad)
    assert store.is_exist("engram:l3:h0") == 0
    es.populate([t.astype(np.float64) for t in tables])  # converted to float32
    with pytest.raises(RuntimeError, match="lookup failed"):
        es.lookup(np.array([[[50, 0, 0]]]))  # row 50 is past head 0's table
    with pytest.raises(RuntimeError, match="shape"):
        es.lookup(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(RuntimeError, match="num_heads"):
        es.lookup(np.zeros((1, 1, 2), dtype=np.int64))
    with pytest.raises(RuntimeError, match="must not be empty"):
        es.lookup([])
    with pytest.raises(RuntimeError, match="lookup failed"):
        es.lookup([[[0, 0, 0]], [[0, 0]]])  # ragged
    with pytest.raises(RuntimeError, match="lookup failed"):
        es.lookup(np.zeros((0, 1, 3), dtype=np.int64))
    cfg = EngramStoreConfig()
    for vocab, dim in (([], 8), ([4, 0], 8), ([4], 0)):
        cfg.table_vocab_sizes, cfg.embedding_dim = vocab, dim
        with pytest.raises(ValueError):
            EngramStore(0, cfg, store)
    with pytest.raises(TypeError):
        cfg.table_vocab_sizes = ["a"]
    nostore = EngramStore(0, EngramStoreConfig())
    with pytest.raises(RuntimeError, match="populate failed"):
        nostore.populate([np.zeros((1024, 64), dtype=np.float32)])
    with pytest.raises(RuntimeError, match="rc=-600"):
        nostore.remove_from_store()
    with pytest.raises(RuntimeError, match="store parameter"):
        EngramStore(0, EngramStoreConfig(), object())
    assert es.remove_from_store() == 3


def test_a_populate_that_does_not_fit_leaves_nothing(store) -> None:
    es, _ = _layer(store, vocab=(16, 4 * MiB), dim=4, layer=9)  # 64 MiB: past the segment
    tables = [np.ones((16, 4), dtype=np.float32), np.ones((4 * MiB, 4), dtype=np.float32)]
    with pytest.raises(RuntimeError, match="populate failed"):
        es.populate(tables)
    assert store.is_exist("engram:l9:h0") == 0 and store.is_exist("engram:l9:h1") == 0
