"""``python -m kvmaster.tools.loadgen``: see :mod:`kvmaster.tools.loadgen.cli`."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
