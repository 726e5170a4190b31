"""Trace-driven, session-aware load generator for kvmaster.

Modules: ``traces`` (Mooncake and kv-cache-tester readers), ``synthetic``
(seeded chat workload), ``sessions`` (online session inference, lifecycle and
retention policies), ``reference`` (exact LRU / Belady / unbounded cache
simulations and a model of each retention policy), ``payload`` (block keys and
self-checking, writer-tagged payloads), ``stats`` (latency histograms),
``monitor`` (master counters and process over time), ``replay`` (dispatcher
and worker processes), ``compare`` and ``plots`` (policy x capacity matrix,
table, PNGs) and ``cli`` (command line).
"""
