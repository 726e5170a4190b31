"""Settings of a process that runs a master or a shard actor (not of an application
that embeds one)."""

from __future__ import annotations

import gc


def tune_gc(threshold: int) -> None:
    """Collector settings of a process that runs a master or a shard actor
    (``--gc-threshold``; called by ``kvmaster master`` and by each shard process, not by
    :func:`run_master`, so an application embedding a master keeps its own settings).

    The metadata (one object, its replica list, pending writes, session members) is
    long-lived and made of many small GC-tracked objects, and every batch allocates a
    few per key.  At Python's default threshold (700) the collector runs every few
    hundred keys and moves each survivor through two more generations; a threshold of
    10,000 made 1024-key put batches 28 % faster (BENCHMARKS.md).  Everything left
    after start-up (modules, config) is collected once and then frozen out of the
    collector's scans.  Reference counting frees objects as before; only cyclic
    garbage waits for a collection.  ``threshold`` 0 leaves Python's settings alone
    (no freeze either)."""
    if threshold <= 0:
        return
    _, gen1, gen2 = gc.get_threshold()
    gc.collect()
    gc.set_threshold(threshold, gen1, gen2)
    gc.freeze()
