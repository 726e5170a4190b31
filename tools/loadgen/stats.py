"""Latency recording in rounded buckets, per operation name, mergeable across processes;
the prefill work saved by prefix hits (:func:`prefill_saved`).

Latencies are kept in microseconds, rounded to a log-linear bucket (exact below
1,000 µs, three significant digits above: 1,234 µs -> 1,230 µs, 56,789 µs ->
56,800 µs), so a recorder's size grows with the spread of latencies, not with
their number, and the relative error of a percentile is at most 0.5 %.

A recorder travels between processes as a plain dict (:meth:`LatencyRecorder.to_dict`)
made of str, int and lists only, so it is JSON- and pickle-friendly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["bucket_us", "OpStats", "LatencyRecorder", "PERCENTILES", "prefill_saved"]

#: Percentiles reported by :meth:`LatencyRecorder.summary`, as (name, quantile).
PERCENTILES: tuple[tuple[str, float], ...] = (("p50_us", 0.50), ("p99_us", 0.99),
                                              ("p999_us", 0.999))


def bucket_us(value_us: float) -> int:
    """Bucket (in µs) of a latency in µs: exact below 1,000, else 3 significant digits."""
    v = int(round(value_us))
    if v < 1000:
        return max(v, 0)
    factor = 10 ** (len(str(v)) - 3)
    return (v + factor // 2) // factor * factor


@dataclass(slots=True)
class OpStats:
    """Latency histogram of one operation: ``buckets`` maps bucket µs -> count."""

    buckets: dict[int, int] = field(default_factory=dict)
    count: int = 0
    sum_us: float = 0.0
    min_us: float = math.inf
    max_us: float = 0.0

    def add(self, value_us: float, n: int = 1) -> None:
        """Record ``n`` samples of ``value_us`` microseconds."""
        b = bucket_us(value_us)
        self.buckets[b] = self.buckets.get(b, 0) + n
        self.count += n
        self.sum_us += value_us * n
        self.min_us = min(self.min_us, value_us)
        self.max_us = max(self.max_us, value_us)

    def merge(self, other: OpStats) -> None:
        """Add ``other``'s samples to this histogram."""
        for b, n in other.buckets.items():
            self.buckets[b] = self.buckets.get(b, 0) + n
        self.count += other.count
        self.sum_us += other.sum_us
        self.min_us = min(self.min_us, other.min_us)
        self.max_us = max(self.max_us, other.max_us)

    def percentile(self, q: float) -> int | None:
        """Nearest-rank percentile (bucket µs, clamped to the exact min/max) for ``0 <= q <= 1``.

        ``None`` if there are no samples.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count - 1e-9))
        seen = 0
        for b in sorted(self.buckets):
            seen += self.buckets[b]
            if seen >= rank:
                break
        return int(min(max(b, math.floor(self.min_us)), math.ceil(self.max_us)))

    def summary(self) -> dict:
        """``count``, ``mean_us``, ``min_us``, ``max_us`` and the :data:`PERCENTILES`."""
        out: dict = {
            "count": self.count,
            "mean_us": round(self.sum_us / self.count, 1) if self.count else None,
            "min_us": round(self.min_us, 1) if self.count else None,
            "max_us": round(self.max_us, 1) if self.count else None,
        }
        for name, q in PERCENTILES:
            out[name] = self.percentile(q)
        return out

    def to_dict(self) -> dict:
        """Plain dict; ``buckets`` as sorted ``[bucket_us, count]`` pairs."""
        return {
            "buckets": [[b, self.buckets[b]] for b in sorted(self.buckets)],
            "count": self.count,
            "sum_us": self.sum_us,
            "min_us": self.min_us if self.count else None,
            "max_us": self.max_us,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> OpStats:
        """Inverse of :meth:`to_dict`."""
        min_us = d.get("min_us")
        return cls(
            buckets={int(b): int(n) for b, n in d["buckets"]},
            count=int(d["count"]),
            sum_us=float(d["sum_us"]),
            min_us=math.inf if min_us is None else float(min_us),
            max_us=float(d["max_us"]),
        )


class LatencyRecorder:
    """Per-operation latency histograms (op name -> :class:`OpStats`)."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: dict[str, OpStats] = {}

    def record(self, op: str, elapsed_s: float) -> None:
        """Record one sample of ``op`` taking ``elapsed_s`` seconds."""
        self.record_us(op, elapsed_s * 1e6)

    def record_us(self, op: str, value_us: float) -> None:
        """Record one sample of ``op`` taking ``value_us`` microseconds."""
        st = self.ops.get(op)
        if st is None:
            st = self.ops[op] = OpStats()
        st.add(value_us)

    def count(self, op: str) -> int:
        """Samples recorded for ``op`` (0 if none)."""
        st = self.ops.get(op)
        return st.count if st else 0

    def percentile(self, op: str, q: float) -> int | None:
        """Nearest-rank percentile of ``op`` in µs (bucketed); ``None`` if no samples."""
        st = self.ops.get(op)
        return st.percentile(q) if st else None

    def merge(self, other: LatencyRecorder | Mapping) -> LatencyRecorder:
        """Add another recorder (or its :meth:`to_dict` form) into this one; returns self."""
        if not isinstance(other, LatencyRecorder):
            other = LatencyRecorder.from_dict(other)
        for op, st in other.ops.items():
            mine = self.ops.get(op)
            if mine is None:
                mine = self.ops[op] = OpStats()
            mine.merge(st)
        return self

    @classmethod
    def merged(cls, recorders: Iterable[LatencyRecorder | Mapping]) -> LatencyRecorder:
        """New recorder holding the samples of all ``recorders`` (objects or dicts)."""
        out = cls()
        for r in recorders:
            out.merge(r)
        return out

    def to_dict(self) -> dict:
        """Plain dict ``{op: OpStats.to_dict()}`` for pickling or JSON."""
        return {op: st.to_dict() for op, st in self.ops.items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> LatencyRecorder:
        """Inverse of :meth:`to_dict`."""
        out = cls()
        for op, st in d.items():
            out.ops[str(op)] = OpStats.from_dict(st)
        return out

    def summary(self) -> dict:
        """JSON-serialisable ``{op: OpStats.summary()}``, ops sorted by name."""
        return {op: self.ops[op].summary() for op in sorted(self.ops)}


def _nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ascending ``sorted_values`` by nearest rank (0.0 if empty)."""
    if not sorted_values:
        return 0.0
    k = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[k - 1]


def prefill_saved(input_tokens: Sequence[int], hit_tokens: Sequence[int],
                  prefill_tokens_per_s: float) -> dict[str, Any]:
    """Prefill work that prefix hits spared, per request.

    ``input_tokens[i]``: prompt tokens of request ``i``; ``hit_tokens[i]``: its
    prefix-hit blocks times the tokens per block (capped at the prompt, as a
    trailing partial block holds fewer).  At ``prefill_tokens_per_s`` (a
    stated throughput; the store does not measure it), a saved token is
    ``1 / prefill_tokens_per_s`` seconds less time to first token.

    Returns ``requests``, ``prefill_tokens_per_s``, ``input_tokens``,
    ``saved_tokens`` (totals), ``saved_fraction`` (of input tokens),
    ``tokens_per_request`` and ``ttft_saved_ms`` (each ``mean``, ``p50``,
    ``p99``: nearest-rank percentiles over requests), ``ttft_saved_s_total``.
    Raises ``ValueError`` on lists of different lengths or a throughput <= 0.
    """
    if len(input_tokens) != len(hit_tokens):
        raise ValueError(f"{len(input_tokens)} input counts for {len(hit_tokens)} hit counts")
    if not (prefill_tokens_per_s > 0 and math.isfinite(prefill_tokens_per_s)):
        raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
    saved = sorted(min(max(h, 0), max(n, 0)) for n, h in zip(input_tokens, hit_tokens))
    n = len(saved)
    total = sum(saved)
    inputs = sum(max(x, 0) for x in input_tokens)
    ms = 1000.0 / prefill_tokens_per_s

    def dist(scale: float) -> dict[str, float]:
        return {"mean": total / n * scale if n else 0.0,
                "p50": _nearest_rank(saved, 0.50) * scale,
                "p99": _nearest_rank(saved, 0.99) * scale}

    return {"requests": n, "prefill_tokens_per_s": prefill_tokens_per_s,
            "input_tokens": inputs, "saved_tokens": total,
            "saved_fraction": total / inputs if inputs else 0.0,
            "tokens_per_request": dist(1.0), "ttft_saved_ms": dist(ms),
            "ttft_saved_s_total": total / prefill_tokens_per_s}
