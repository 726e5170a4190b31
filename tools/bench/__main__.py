"""``python -m kvmaster.tools.bench``: see :mod:`kvmaster.tools.bench.cli`."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
