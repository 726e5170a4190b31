"""``python -m kvmaster.tools.bench``: see :mod:`kvmaster.tools.bench.store_bench`."""

from __future__ import annotations

from .store_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
