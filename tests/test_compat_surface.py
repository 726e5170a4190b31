"""docs/compat.md is what tools/compat_table.py writes from the code, and every name of
Mooncake's surface that the page calls served is there and callable."""

from __future__ import annotations

import kvmaster.compat as compat
from kvmaster.compat import MooncakeDistributedStore, ReplicateConfig
from kvmaster.tools import compat_table as T


def test_the_page_is_current() -> None:
    assert T.main(["--check"]) == 0, "run: python -m kvmaster.tools.compat_table"


def test_every_mooncake_name_is_there() -> None:
    cfg = ReplicateConfig()
    missing = ([n for n in T.MODULE if not hasattr(compat, n)]
               + [n for n in T.METHODS if not callable(getattr(MooncakeDistributedStore, n, None))]
               + [n for n in T.FIELDS if not hasattr(cfg, n)])
    assert missing == []
    assert len(T.METHODS) == len(set(T.METHODS))
    assert set(T.NOTES) <= set(T.MODULE) | set(T.METHODS) | set(T.FIELDS)
