"""The master's own work per key, without sockets or a client: one shard actor called
directly with encoded requests, as the front hands them over.

``python -m kvmaster.tools.bench actor [--rounds N] [--keys K] [--value-bytes B]``

Each round starts a batch write of K fresh keys (BATCH_PUT_START, columnar reply),
ends it (BATCH_PUT_END), reads it (BATCH_GET_REPLICA_LIST, leases granted), asks
whether the K keys exist (BATCH_EXIST_KEY, every key a hit), then whether K absent
keys do (every key a miss), and removes the batch (BATCH_REMOVE with force, so the
leased ranges are freed at their lease's end).
Each call is timed from the envelope's delivery to the end of the actor's drain
(decode, handle, encode the reply).  It prints µs per key for each op, the minimum
and the median over rounds.  The VM's phases move medians by up to 2x from one run to
the next; the minimum of many rounds is the steadier figure for an A/B of two
versions (run it with each on ``PYTHONPATH``, alternating).  ``--eviction-policy
lru,prefix-lru`` measures each policy on its own actor in the same run, alternating
blocks of rounds (a tenth of them each), so both see the same phases.
``--checksums off,on`` does the same for object checksums (protocol 1.4): "on" ends
each write with one checksum per key (BATCH_PUT_END ``checksums``) and reads with
``with_checksum`` (the checksums column), as a client with the defaults does; "off" as
a client with ``write_checksums`` and ``verify_checksums`` off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import msgpack

from kvmaster._shard import ClientView, ShardActor
from kvmaster.config import MasterConfig
from kvmaster.protocol import Op, decode_reply

OPS = ("put_start", "put_end", "get", "exist_hit", "exist_miss", "remove")


def measure(rounds: int, keys: int, value_bytes: int,
            eviction_policy: str = "", checksums: bool = False,
            **config: Any) -> dict[str, list[float]]:
    """Seconds per call of each op in :data:`OPS`, one entry per round.  Raises
    RuntimeError if any call is not answered 0 (every per-key status 0 too, and every
    exist item 1 for the batch's keys and 0 for the absent ones)."""
    return _Bench(rounds, keys, value_bytes, eviction_policy, config,
                  checksums=checksums).run(0, rounds)


class _Bench:
    """One actor and its rounds; :meth:`run` does rounds ``[start, stop)``."""

    def __init__(self, rounds: int, keys: int, value_bytes: int,
                 eviction_policy: str = "", config: dict[str, Any] | None = None,
                 tenant: str = "default", checksums: bool = False) -> None:
        self.times: dict[str, list[float]] = {op: [] for op in OPS}
        self._gen = _rounds(rounds, keys, value_bytes, eviction_policy, self.times,
                            config or {}, tenant, checksums)
        next(self._gen)  # (the actor is set up)

    def run(self, start: int, stop: int) -> dict[str, list[float]]:
        for _ in range(start, stop):
            next(self._gen)
        return self.times


def _rounds(rounds: int, keys: int, value_bytes: int, eviction_policy: str,
            times: dict[str, list[float]], more: dict[str, Any], tenant: str,
            checksums: bool = False) -> Any:
    replies: list[bytes] = []
    extra = {"eviction_policy": eviction_policy} if eviction_policy else {}
    config = MasterConfig(**{"shards": 1, "eviction_high_watermark_ratio": 1.0, **extra,
                             **more})
    shard = ShardActor(0, 1, config, lambda identity, op, payload, group: replies.append(payload))
    shard.peers = [shard]
    # Room for every round's objects: removed ones stay leased until their lease ends.
    shard.mount_segment("bench", "bench", max(1 << 30, 2 * rounds * keys * value_bytes),
                        tenant)
    client = ClientView("bench", tenant, b"bench")
    req = 0

    def call(name: str, op: Op, *fields: Any, expect: int | None = None) -> None:
        nonlocal req
        req += 1
        payload = msgpack.packb([req, *fields], use_bin_type=True)
        t0 = time.perf_counter()
        shard.deliver((op.value, payload, client))
        shard.drain()
        times[name].append(time.perf_counter() - t0)
        _, status, body = decode_reply(replies.pop())
        per_key = body[1] if op in (Op.BATCH_PUT_START, Op.BATCH_GET_REPLICA_LIST) else body
        if status or min(per_key, default=0) < 0 or (
                expect is not None and per_key.count(expect) != len(per_key)):
            raise RuntimeError(f"{op.name} answered {status}: {str(body)[:200]}")

    # 64-bit checksums as a client sends them (any values: the master only keeps them).
    sums = [(0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1) for i in range(keys)]
    end_tail: list[Any] = [sums] if checksums else []
    get_tail: list[Any] = [True] if checksums else []
    yield
    for r in range(rounds):
        batch = [b"bench-%d-%d" % (r, i) for i in range(keys)]
        call("put_start", Op.BATCH_PUT_START, batch, [value_bytes] * keys, None, r + 1, True)
        call("put_end", Op.BATCH_PUT_END, batch, r + 1, *end_tail)
        call("get", Op.BATCH_GET_REPLICA_LIST, batch, True, *get_tail)
        call("exist_hit", Op.BATCH_EXIST_KEY, batch, expect=1)
        call("exist_miss", Op.BATCH_EXIST_KEY, [b"absent-" + k for k in batch], expect=0)
        call("remove", Op.BATCH_REMOVE, batch, True)
        yield


def _variant(text: str) -> dict[str, Any]:
    """``field=value,...`` (MasterConfig fields; ints, floats or strings) -> kwargs."""
    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        for conv in (int, float):
            try:
                out[name] = conv(value)
                break
            except ValueError:
                continue
        else:
            out[name] = value
    return out


def run(a: argparse.Namespace) -> int:
    policies = [p for p in (getattr(a, "eviction_policy", "") or "").split(",") if p] or [""]
    variants = getattr(a, "variant", None) or [""]
    tenant = getattr(a, "tenant", "default")
    sums = [c == "on" for c in (getattr(a, "checksums", "") or "off").split(",") if c]
    cells = [(p, v, c) for p in policies for v in variants for c in sums]
    benches = [_Bench(a.rounds, a.keys, a.value_bytes, p, _variant(v), tenant, c)
               for p, v, c in cells]
    block = max(1, a.rounds // 10)
    for start in range(0, a.rounds, block):
        for b in benches:
            b.run(start, min(a.rounds, start + block))
    for (p, v, c), b in zip(cells, benches):
        if p or len(variants) > 1 or len(sums) > 1:
            print(" ".join(([f"--eviction-policy {p}"] if p else [])
                           + ([f"variant [{v}]"] if len(variants) > 1 else [])
                           + ([f"checksums {'on' if c else 'off'}"] if len(sums) > 1 else []))
                  + ":")
        _print(a, b.times)
    return 0


def _print(a: argparse.Namespace, times: dict[str, list[float]]) -> None:
    print(f"one shard actor, {a.keys}-key batches of {a.value_bytes} B values, "
          f"{a.rounds} rounds: µs per key, min / median")
    for op in OPS:
        t = times[op]
        print(f"  {op:<10} {min(t) * 1e6 / a.keys:6.3f} / "
              f"{statistics.median(t) * 1e6 / a.keys:6.3f}")
    put = [s + e for s, e in zip(times["put_start"], times["put_end"])]
    print(f"  {'put (both)':<10} {min(put) * 1e6 / a.keys:6.3f} / "
          f"{statistics.median(put) * 1e6 / a.keys:6.3f}")
