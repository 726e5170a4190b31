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
    assert set(missing) == T.NOT_PROVIDED
    assert len(T.METHODS) == len(set(T.METHODS))
    assert set(T.NOTES) <= set(T.MODULE) | set(T.METHODS) | set(T.FIELDS)


def test_the_mooncake_tests_left_out_are_the_harnesses_own() -> None:
    from engines import test_mooncake_dummy, test_mooncake_replicas, test_mooncake_suite

    listed = {f: set(v) for f, v in T.MOONCAKE_TESTS.items()}
    for f, ex in {**test_mooncake_suite.EXCLUDED, **test_mooncake_replicas.EXCLUDED}.items():
        assert {t.rsplit(".", 1)[-1] for t in ex} == listed[f], f
    assert set(test_mooncake_dummy.NEEDS_CUDA) == listed["test_dummy_client.py"]
    engines = T.MOONCAKE_HARNESS.keys()
    from engines.conftest import ENGINES

    assert {p.name for p in (ENGINES / "mooncake").iterdir() if p.suffix == ".py"} == set(engines)


def test_no_two_families_define_the_same_name() -> None:
    """The store is one class made of families: a name two of them define (a private
    helper above all) would silently shadow the other's."""
    import inspect

    fams = [c for c in MooncakeDistributedStore.__mro__[1:]
            if c.__module__.startswith("kvmaster.compat.") and c.__name__ != "Facade"]
    # Deliberate overrides, each calling the next family's through super().
    chained = {"register_buffer", "unregister_buffer", "close"}
    seen: dict[str, str] = {}
    clashes = []
    for cls in fams:
        for name, _ in inspect.getmembers(cls):
            if name.startswith("__") or name not in vars(cls):
                continue
            if name in seen and name not in chained:
                clashes.append(f"{name}: {seen[name]} and {cls.__name__}")
            seen.setdefault(name, cls.__name__)
    assert clashes == []
