"""The engines' own Mooncake client code (``../shared/engines``), run unmodified
against a real master through the ``mooncake`` compat shim.

``shim`` installs ``kvmaster compat-shim`` into a temporary folder once per run
and puts it first on ``sys.path`` (and on ``PYTHONPATH`` for subprocesses), so
``from mooncake.store import ...`` in an engine's file loads kvmaster's facade.
``engine_file(rel)`` is the path of one of the engines' files; the whole module
fails (it does not skip) when ``../shared/engines`` is missing."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvmaster.compat import shim as shim_mod

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVMASTER_SHARED", REPO.parent / "shared"))
ENGINES = SHARED / "engines"
#: Modules the engines import beyond their own files, supplied by the harness.
STUBS = Path(__file__).resolve().parent / "stubs"


def engine_file(rel: str) -> Path:
    """``../shared/engines/<rel>``; fails the test when it is not there."""
    p = ENGINES / rel
    if not p.is_file():
        pytest.fail(f"engine file {p} is missing: the engines' code lives in "
                    f"../shared/engines next to the repository (or $KVMASTER_SHARED)")
    return p


def load_module(name: str, path: Path) -> ModuleType:
    """Import the file ``path`` as module ``name`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder holding the installed ``mooncake`` shim, first on ``sys.path``."""
    target = tmp_path_factory.mktemp("mooncake-shim")
    shim_mod.install(target)
    sys.path.insert(0, str(target))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), old) if p)
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        for m in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
            del sys.modules[m]


@pytest.fixture
def make_store(master):
    """Factory: ``make_store(segment_bytes, local_buffer_bytes)`` -> a
    ``kvmaster.compat.MooncakeDistributedStore`` set up Mooncake's positional way against
    the test's master; each is closed (0 asserted) after the test."""
    from kvmaster.compat import MooncakeDistributedStore

    made: list[MooncakeDistributedStore] = []

    def make(segment: int = 8 << 20, local_buffer: int = 16 << 20) -> MooncakeDistributedStore:
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "P2PHANDSHAKE", segment, local_buffer, "tcp", "",
                       master.addr) == 0
        made.append(s)
        return s

    yield make
    for s in made:
        assert s.close() == 0
