"""The facade's tensor and byte-range calls (kvmaster/compat/_tensor.py, _ranges.py)
against a real master: Mooncake's tensor object layout byte for byte, its shard keys
and manifests, its return conventions, and the native ranged read under them."""

from __future__ import annotations

import ctypes
import struct
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kvmaster.compat import (MooncakeDistributedStore, ParallelAxis, ReadTarget,  # noqa: E402
                             ReplicateConfig, TensorParallelism, _deserialize_tensor,
                             _serialize_tensor, _tensor_metadata_size)
from kvmaster.compat import _tensor as T  # noqa: E402

INVALID, NOT_FOUND = -600, -704


@pytest.fixture
def store(master):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.addr) == 0
    yield s
    s.close()


def axis(kind, rank, size, split_dim=None, **kw):
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim = kind, rank, size, split_dim
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def par(*axes):
    p = TensorParallelism()
    p.axes = list(axes)
    return p


def target(mode, parallelism=None):
    t = ReadTarget()
    t.mode, t.parallelism = mode, parallelism
    return t


class Writer:
    def __init__(self, rank, size, split_dim):
        self.rank, self.size, self.split_dim = rank, size, split_dim


def registered(store, size):
    buf = ctypes.create_string_buffer(size)
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, size) == 0
    return buf, ptr


# ------------------------------------------------------------------ layout


def test_metadata_layout_offsets():
    """The header and layout fields sit where Mooncake's C structs put them
    (integration_utils.h: TensorObjectHeader 40 bytes, TensorLayoutMetadata 264)."""
    t = torch.arange(6, dtype=torch.int32).view(2, 3)
    meta, ptr, size, owner = _serialize_tensor(t)
    assert _tensor_metadata_size() == len(meta) == 304 and size == 24
    assert ctypes.string_at(ptr, size) == t.numpy().tobytes()
    assert struct.unpack_from("<IHH", meta, 0) == (0x4D4F4F4E, 1, 304)
    assert struct.unpack_from("<iiII", meta, 8) == (6, 2, 0, 0)  # int32, 2 dims, FULL
    assert struct.unpack_from("<QQ", meta, 24) == (304, 24)
    assert struct.unpack_from("<8q", meta, 40) == (2, 3, -1, -1, -1, -1, -1, -1)
    assert struct.unpack_from("<8q", meta, 104) == (2, 3, -1, -1, -1, -1, -1, -1)
    assert struct.unpack_from("<II", meta, 168) == (0, 0)
    assert meta[176:] == bytes(128)


def test_shard_metadata_axes():
    axes = [(0, 1, 2, None, None, None), (1, 0, 2, 1, None, None)]
    m = T.TensorMeta(0, (2, 4), (2, 2), 16, T.LAYOUT_SHARD, T._layout_axes(axes, (2, 2)))
    b = m.pack()
    assert struct.unpack_from("<I", b, 16) == (1,)
    assert struct.unpack_from("<II", b, 168) == (2, 0)
    assert struct.unpack_from("<iiiiiiq", b, 176) == (0, 0, 1, 2, -1, 0, -1)
    assert struct.unpack_from("<iiiiiiq", b, 208) == (1, 1, 0, 2, 1, 0, 2)
    assert T.parse_meta(b + bytes(16), 320) == m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.uint8,
                                   torch.int16, torch.int32, torch.int64, torch.bool,
                                   torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.uint16, torch.uint32,
                                   torch.uint64])
def test_serialize_round_trip_every_dtype(dtype):
    t = (torch.arange(12) % 2).to(dtype).view(3, 4)
    meta, ptr, size, _ = _serialize_tensor(t)
    back = _deserialize_tensor(meta + ctypes.string_at(ptr, size))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_serialize_edge_shapes_and_refusals():
    for t in (torch.tensor(3.5), torch.empty(0, 4), torch.ones(1, 1, 1, 1, 1, 1, 1, 1)):
        meta, ptr, size, _ = _serialize_tensor(t)
        back = _deserialize_tensor(meta + (ctypes.string_at(ptr, size) if size else b""))
        assert back.shape == t.shape and torch.equal(back, t)
    with pytest.raises(ValueError):
        _serialize_tensor(torch.ones([1] * 9))
    with pytest.raises(ValueError):
        _serialize_tensor(b"not a tensor")
    good, ptr, size, _ = _serialize_tensor(torch.ones(4))
    payload = good + ctypes.string_at(ptr, size)
    for bad in (payload[:-1], b"\0" + payload[1:], payload[:100],
                payload[:32] + struct.pack("<Q", 3) + payload[40:]):
        with pytest.raises(ValueError):
            _deserialize_tensor(bad)


def test_import_does_not_load_torch():
    code = "import sys, kvmaster.compat; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------ plain calls


def test_put_get_and_the_stored_bytes(store):
    t = torch.randn(5, 7)
    assert store.put_tensor("t", t) == 0
    assert torch.equal(store.get_tensor("t"), t)
    meta, ptr, size, _ = _serialize_tensor(t)
    assert store.get("t") == meta + ctypes.string_at(ptr, size)  # Mooncake's object bytes
    assert store.get_tensor("missing") is None
    assert store.put_tensor("x", [1, 2]) == INVALID
    assert store.put("raw", b"not a tensor object at all") == 0
    assert store.get_tensor("raw") is None


def test_get_into_shares_the_buffer_and_from_writes_it_back(store):
    t = torch.ones(10)
    assert store.put_tensor("k", t) == 0
    buf, ptr = registered(store, 304 + 40)
    got = store.get_tensor_into("k", ptr, 344)
    got.fill_(7.0)
    assert store.upsert_tensor_from("k", ptr, 344) == 0
    assert torch.equal(store.get_tensor("k"), torch.full((10,), 7.0))
    assert store.put_tensor_from("k2", ptr, 344) == 0
    assert torch.equal(store.get_tensor("k2"), torch.full((10,), 7.0))
    assert store.get_tensor_into("k", ptr, 100) is None  # too small
    assert store.get_tensor_into("k", 0, 344) is None
    ctypes.memset(ptr, 0, 8)  # the magic gone: not a tensor object
    assert store.put_tensor_from("k3", ptr, 344) == INVALID
    assert store.batch_put_tensor_from(["a", "b"], [ptr], [344]) == [INVALID, INVALID]


def test_batch_calls(store):
    keys = ["b0", "b1", "b2"]
    ts = [torch.randn(3), torch.arange(4), torch.zeros(2, 2, dtype=torch.bfloat16)]
    assert store.batch_put_tensor(keys, ts) == [0, 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(store.batch_get_tensor(keys), ts))
    assert store.batch_put_tensor(keys, ts[:2]) == [INVALID] * 3
    assert store.batch_put_tensor(["c0", "c1"], [ts[0], "nope"]) == [0, INVALID]
    new = [t + 1 for t in ts]
    assert store.batch_upsert_tensor(keys, new) == [0, 0, 0]
    assert store.batch_get_tensor(keys + ["nope"])[3] is None
    sizes = [304 + t.numel() * t.element_size() for t in new]
    bufs = [registered(store, s) for s in sizes]
    got = store.batch_get_tensor_into(keys, [p for _, p in bufs], sizes)
    assert all(torch.equal(a, b) for a, b in zip(got, new))
    assert store.batch_get_tensor_into(keys, [0, 0, 0], sizes) == [INVALID] * 3
    cfg = ReplicateConfig()
    assert store.batch_upsert_pub_tensor(keys, ts, cfg) == [0, 0, 0]
    assert store.batch_pub_tensor(["p0"], [ts[0]], cfg) == [0]
    assert store.upsert_pub_tensor("p0", ts[1], cfg) == 0
    assert torch.equal(store.get_tensor("p0"), ts[1])


def test_cuda_calls_refuse_without_a_device(store):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the refusal does not apply")
    assert store.put_tensor("c", torch.ones(2)) == 0
    assert store.get_tensor_into_cuda("c", torch.empty(2)) == INVALID
    assert store.batch_get_tensor_into_cuda(["c", "c"], [torch.empty(2)] * 2) == [INVALID] * 2


def test_cuda_reads_into_a_device_tensor(store):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.randn(4, 8)
    assert store.put_tensor("g", t) == 0
    dst = torch.empty(4, 8, device="cuda")
    assert store.get_tensor_into_cuda("g", dst) == t.numel() * 4
    assert torch.equal(dst.cpu(), t)
    wrong = torch.empty(8, 4, device="cuda")
    assert store.batch_get_tensor_into_cuda(["g", "nope"], [wrong, dst]) == [INVALID, INVALID]
    assert store.put_tensor("g2", t.cuda()) == 0  # a device tensor is stored from host bytes
    assert torch.equal(store.get_tensor("g2"), t)


# ----------------------------------------------------------- parallelism


def test_with_tp_stores_every_shard(store):
    t = torch.arange(16, dtype=torch.float32).view(4, 4)
    assert store.put_tensor_with_tp("w", t, tp_size=2, split_dim=1) == 0
    for r in range(2):
        shard = store.get_tensor_with_tp("w", r, 2, 1)
        assert torch.equal(shard, t.chunk(2, 1)[r])
        meta = T.parse_meta(store.get(f"w_tp_{r}"), len(store.get(f"w_tp_{r}")))
        assert meta.layout_kind == T.LAYOUT_SHARD and meta.global_shape == (4, 4)
        assert meta.axes == [(1, 0, r, 2, 1, 0, 2)]
    assert store.put_tensor_with_tp("w", torch.ones(3, 3), tp_size=2) == INVALID
    got = store.batch_get_tensor_with_tp(["w", "nope"], tp_rank=1, tp_size=2)
    assert torch.equal(got[0], t.chunk(2, 1)[1]) and got[1] is None
    assert torch.equal(store.get_tensor_with_tp("w_tp_0"), t.chunk(2, 1)[0])  # tp_size 1


def test_parallelism_keys_and_reads(store):
    full = torch.arange(8, dtype=torch.float32).view(2, 4)
    p = par(axis("tp", 1, 2, 1), axis("DP", 0, 2))
    assert T.parallelism_key("k", T._parse_axes(p)) == "k__dp_0of2__tp_1of2_sd1"
    assert store.put_tensor_with_parallelism("k", full, p) == 0
    assert torch.equal(store.get_tensor("k__dp_0of2__tp_1of2_sd1"), full.chunk(2, 1)[1])
    assert torch.equal(store.get_tensor_with_parallelism("k", target("shard", p)),
                       full.chunk(2, 1)[1])
    man = T._parse_manifest(store.get("k__parallelism_manifest"))
    assert man == (0, (2, 4), 1, 2)
    # the other TP rank too: the full tensor is rebuilt from both
    assert store.put_tensor_with_parallelism("k", full, par(axis("tp", 0, 2, 1),
                                                            axis("dp", 0, 2))) == 0
    assert torch.equal(store.get_tensor_with_parallelism("k", target("full", p)), full)
    # a single TP axis takes the tensor as that rank's shard, under the legacy key
    single = par(axis("tp", 0, 2, 0))
    assert store.put_tensor_with_parallelism("s", full, single) == 0
    assert torch.equal(store.get_tensor("s_tp_0"), full)
    assert T.parse_meta(store.get("s_tp_0"), 304 + 32).global_shape == (4, 4)
    # refusals: both requests, a bad axis, non-uniform splits, a bad mode
    assert store.put_tensor_with_parallelism("r", full, p, writer_partition=Writer(0, 2, 1)) \
        == INVALID
    assert store.put_tensor_with_parallelism("r", full, par(axis("dp", 0, 2, 1))) == INVALID
    assert store.put_tensor_with_parallelism("r", full, par(axis("pp", 0, 2))) == INVALID
    assert store.put_tensor_with_parallelism("r", full, par(axis("tp", 0, 3, 1),
                                                            axis("dp", 0, 2))) == INVALID
    assert store.get_tensor_with_parallelism("r", target("shard", p)) is None
    with pytest.raises(RuntimeError):
        target("sideways")


def test_writer_partitions_and_full_reads(store):
    full = torch.arange(16, dtype=torch.float32).view(4, 4)
    for r in range(2):
        assert store.put_tensor_with_parallelism("w", full, writer_partition=Writer(r, 2, 0)) == 0
    assert torch.equal(store.get_tensor("w__writer_1of2_sd0"), full.chunk(2, 0)[1])
    raw = store.get("w__writer_manifest")
    assert len(raw) == 96 and struct.unpack_from("<IHHiiiii", raw, 0) == (
        0x574D414E, 1, 96, 0, 2, 0, 2, 0)
    assert torch.equal(store.get_tensor_with_parallelism("w", target("full")), full)
    # a single-TP shard read finds the writer shard of the same split
    assert torch.equal(store.get_tensor_with_parallelism(
        "w", target("shard", par(axis("tp", 1, 2, 0)))), full.chunk(2, 0)[1])
    assert store.put_tensor_with_parallelism("x", torch.ones(3, 3),
                                             writer_partition=Writer(0, 2, 0)) == INVALID
    assert store.get_tensor_with_parallelism("x", target("full")) is None
    # from a full tensor object in a buffer
    blob = store.get("w__writer_1of2_sd0")  # a shard object is no full tensor for writers
    meta, ptr, size, _ = _serialize_tensor(full + 1)
    buf, bptr = registered(store, 304 + size)
    ctypes.memmove(bptr, meta + ctypes.string_at(ptr, size), 304 + size)
    for r in range(2):
        assert store.upsert_tensor_with_parallelism_from("w", bptr, 304 + size,
                                                         writer_partition=Writer(r, 2, 0)) == 0
    assert torch.equal(store.get_tensor_with_parallelism("w", target("full")), full + 1)
    assert len(blob) == 304 + 32
    got = store.batch_get_tensor_with_parallelism(["w", "x"], [target("full")] * 2)
    assert torch.equal(got[0], full + 1) and got[1] is None
    out, optr = registered(store, 304 + size)
    into = store.get_tensor_with_parallelism_into("w", optr, 304 + size, target("full"))
    assert torch.equal(into, full + 1)
    assert store.get_tensor_with_parallelism_into("w", optr, 100, target("full")) is None
    # a shard read as stored lands with its own shard metadata
    shard = store.get_tensor_with_parallelism_into(
        "w", optr, 304 + size, target("shard", par(axis("tp", 0, 2, 0))))
    assert torch.equal(shard, (full + 1).chunk(2, 0)[0])
    assert ctypes.string_at(optr, 304 + size // 2) == store.get("w__writer_0of2_sd0")


def test_batch_parallelism_requests(store):
    ts = [torch.arange(8.0).view(2, 4), torch.arange(6.0).view(2, 3)]
    ps = [par(axis("tp", 0, 2, 1), axis("dp", 0, 2))] * 2
    assert store.batch_put_tensor_with_parallelism(["a", "b"], ts, ps) == [0, INVALID]
    assert store.batch_put_tensor_with_parallelism(["a", "b"], ts, ps,
                                                   writer_partitions=[None, None]) == [INVALID] * 2
    assert store.batch_put_tensor_with_parallelism(["a", "b"], ts, ps[:1]) == [INVALID] * 2
    assert store.batch_upsert_tensor_with_parallelism(["a", "b"], ts) == [0, 0]
    assert torch.equal(store.get_tensor("b"), ts[1])


# ---------------------------------------------------------------- ranges


def test_get_into_ranges(store):
    data = bytes(range(64))
    assert store.put("r", data) == 0
    buf, ptr = registered(store, 32)
    res = store.get_into_ranges([ptr], [["r", "gone"]], [[[0, 10], [20]]],
                                [[[5, 60], [0]]], [[[4, 4], [4]]])
    assert res == [[[4, 4], [NOT_FOUND]]]
    assert buf.raw[0:4] == data[5:9] and buf.raw[10:14] == data[60:64]
    # past the object, past the buffer, mismatched lists, an unregistered buffer
    assert store.get_into_ranges([ptr], [["r"]], [[[0]]], [[[61]]], [[[4]]]) == [[[INVALID]]]
    assert store.get_into_ranges([ptr], [["r"]], [[[30]]], [[[0]]], [[[4]]]) == [[[INVALID]]]
    assert store.get_into_ranges([ptr], [["r", "r"]], [[[0], []]], [[[0, 1], []]],
                                 [[[], []]]) == [[[INVALID], []]]
    assert store.get_into_ranges([ptr, ptr], [["r"]], [[[0]]], [[[0]]], [[[1]]]) == [[[INVALID]]]
    other = ctypes.create_string_buffer(8)
    assert store.get_into_ranges([ctypes.addressof(other)], [["r"]], [[[0]]], [[[0]]],
                                 [[[4]]]) == [[[INVALID]]]
    assert store.unregister_buffer(ptr) == 0
    assert store.get_into_ranges([ptr], [["r"]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID]]]


def test_get_into_ranges_leases_in_rounds(store, monkeypatch):
    from kvmaster.compat import _ranges

    monkeypatch.setattr(_ranges, "LEASE_BATCH", 2)
    keys = [f"lr{i}" for i in range(5)]
    for i, k in enumerate(keys):
        assert store.put(k, bytes([i]) * 8) == 0
    buf, ptr = registered(store, 16)
    res = store.get_into_ranges([ptr, ptr + 8], [keys[:3], keys[3:] + ["gone"]],
                                [[[0], [1], [2]], [[0], [1], [2]]],
                                [[[0], [7], [3]], [[1], [2], [0]]],
                                [[[1], [1], [1]], [[1], [1], [1]]])
    assert res == [[[1], [1], [1]], [[1], [1], [NOT_FOUND]]]
    assert buf.raw[:3] == bytes([0, 1, 2]) and buf.raw[8:10] == bytes([3, 4])


def test_native_get_into_ranges(client):
    client.put("n", b"abcdefgh")
    dst = bytearray(8)
    assert client.get_into_ranges("n", dst, [(0, 4, 4), (6, 0, 2), (7, 7, 2)]) == [4, 2, INVALID]
    assert dst == b"efgh\0\0ab"


def test_upsert_parts_and_put_from_with_metadata(store):
    assert store.upsert_parts("u", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get("u") == b"abcdef"
    assert store.upsert_parts("u", b"xyz") == 0
    assert store.get("u") == b"xyz"
    assert store.upsert_parts("u") == INVALID
    with pytest.raises(TypeError):
        store.upsert_parts("u", memoryview(b"abcd").cast("B", (2, 2)))
    data, meta = ctypes.create_string_buffer(b"DATA", 4), ctypes.create_string_buffer(b"MD", 2)
    assert store.put_from_with_metadata("m", ctypes.addressof(data), ctypes.addressof(meta),
                                        4, 2) == 0
    assert store.get("m") == b"MDDATA"
    assert store.put_from_with_metadata("m2", 0, 0, 4, 0) == INVALID
