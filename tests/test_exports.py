"""Public surface: sorted ``__all__`` lists whose names all resolve, and a codec
that can be imported without zmq."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

MODULES = ["kvmaster", "kvmaster.protocol"]


@pytest.fixture(autouse=True)
def no_leaked_segments() -> None:
    """Overrides the conftest fixture: nothing here creates shared memory, and its
    /dev/shm scan would otherwise see segments of unrelated concurrent runs."""


def isort_key(name: str) -> tuple[int, str]:
    """Order of ruff's RUF022 default ("isort-style"): SCREAMING_SNAKE_CASE constants,
    then CamelCase classes, then everything else; alphabetical within each group.
    For a list of only CamelCase names plus dunders this is plain ``sorted``."""
    if name.isupper() and len(name) > 1:
        group = 0
    elif name[:1].isupper():
        group = 1
    else:
        group = 2
    return group, name


@pytest.mark.parametrize("module", MODULES)
def test_all_is_sorted_and_unique(module: str) -> None:
    names = importlib.import_module(module).__all__
    assert len(set(names)) == len(names)
    assert list(names) == sorted(names, key=isort_key)


@pytest.mark.parametrize("module", MODULES)
def test_all_names_resolve(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing


def test_star_import_of_the_codec() -> None:
    ns: dict[str, object] = {}
    exec("from kvmaster.protocol import *", ns)  # noqa: S102
    import kvmaster.protocol as P

    assert {n for n in ns if not n.startswith("__")} == set(P.__all__)


def _fresh_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_codec_module_is_a_leaf() -> None:
    """protocol.py on its own (without the package __init__) loads only stdlib and msgpack."""
    out = _fresh_python("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("codec", "kvmaster/protocol.py")
        mod = sys.modules["codec"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("zmq", "kvmaster", "uvloop")))
    """)
    assert out == "[]"


def test_importing_the_codec_does_not_load_zmq() -> None:
    out = _fresh_python("""
        import sys
        import kvmaster.protocol
        print(sorted(m for m in sys.modules if m == "zmq" or m.startswith("zmq.")))
    """)
    assert out == "[]"


def test_every_package_is_in_the_distribution() -> None:
    """pyproject.toml's explicit package list names every package of kvmaster/ and of
    tools/ (installed as kvmaster.tools): one left out is missing from a wheel, and an
    installed kvmaster fails at import (an editable install maps whole folders and
    would not show it)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library "
                                  "from Python 3.11")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = set()
    for root, name in (("kvmaster", "kvmaster"), ("tools", "kvmaster.tools")):
        for init in (REPO / root).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / root).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"packages not in pyproject.toml: {sorted(found - listed)}"
