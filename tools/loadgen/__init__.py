"""Trace-driven load generator for kvmaster.

Modules: ``traces`` (trace readers), ``synthetic`` (seeded chat workload),
``reference`` (exact LRU / Belady / unbounded cache simulations), ``payload``
(block keys and self-checking payloads), ``stats`` (latency histograms),
``replay`` (multi-process replay driver) and ``cli`` (command line).
"""
