"""Stand-in for ``sglang.srt.observability.metrics_collector``: StorageMetrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StorageMetrics:
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)
