"""An opt-in ``mooncake`` package that resolves to kvmaster's facade, so an engine's
``from mooncake.store import MooncakeDistributedStore`` runs unmodified.

``kvmaster compat-shim install [--target DIR]`` writes a small ``mooncake``
package into DIR (default: this interpreter's site-packages): ``mooncake.store``
re-exports ``kvmaster.compat``, ``mooncake.mooncake_config`` its
``MooncakeConfig``.  Every file it writes carries a marker line, so
``uninstall`` removes only what ``install`` wrote, and ``install`` refuses to
write over, or silently sit beside, a real Mooncake install: a ``mooncake``
package without the marker found on ``sys.path`` is named and the install stops
unless ``--shadow`` is given (then the order of ``sys.path`` decides, and a
warning at import says which one won).  ``status`` tells which ``mooncake``
an ``import`` would load.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path

MARKER = "# kvmaster compat shim: written by 'kvmaster compat-shim install'"

_FILES = {
    "__init__.py": f'''{MARKER}
"""kvmaster's stand-in for the ``mooncake`` package (``kvmaster compat-shim``)."""
KVMASTER_SHIM = True
''',
    "store.py": f'''{MARKER}
"""``mooncake.store`` served by kvmaster (:mod:`kvmaster.compat`)."""
import kvmaster.compat as _compat
from kvmaster.compat import *  # noqa: F401,F403
from kvmaster.compat import __all__  # noqa: F401
_compat.shim_loaded(__file__)
''',
    "mooncake_config.py": f'''{MARKER}
"""``mooncake.mooncake_config`` served by kvmaster (:mod:`kvmaster.compat`)."""
from kvmaster.compat import MooncakeConfig  # noqa: F401
''',
}


def default_target() -> Path:
    """This interpreter's site-packages (``sysconfig`` ``purelib``)."""
    return Path(sysconfig.get_paths()["purelib"])


def _is_marked(f: Path) -> bool:
    """Whether the file ``f`` starts with the shim's marker line."""
    try:
        with f.open("rb") as fh:
            return fh.read(len(MARKER)) == MARKER.encode()
    except OSError:
        return False


def _is_ours(pkg: Path) -> bool:
    return _is_marked(pkg / "__init__.py")


def real_mooncake(exclude: Path | None = None) -> list[Path]:
    """``mooncake`` package folders on ``sys.path`` that this shim did not write."""
    found: list[Path] = []
    for entry in sys.path:
        pkg = Path(entry or ".") / "mooncake"
        if pkg.is_dir() and not _is_ours(pkg) and (exclude is None or pkg != exclude):
            if (pkg / "__init__.py").exists() or any(pkg.glob("store*.so")):
                found.append(pkg.resolve())
    return list(dict.fromkeys(found))


def install(target: Path, shadow: bool = False) -> Path:
    """Write the shim package into ``target``; its folder.  Raises FileExistsError
    when ``target/mooncake`` exists and is not ours, RuntimeError when another
    ``mooncake`` is on ``sys.path`` and ``shadow`` is False."""
    pkg = target / "mooncake"
    if pkg.exists() and not _is_ours(pkg):
        raise FileExistsError(f"{pkg} is a real mooncake install; not writing over it")
    others = real_mooncake(exclude=pkg)
    if others and not shadow:
        raise RuntimeError(f"a real mooncake is installed at {others[0]}; the shim would "
                           "shadow it or be shadowed by it (give --shadow to install anyway)")
    pkg.mkdir(parents=True, exist_ok=True)
    for name, text in _FILES.items():
        (pkg / name).write_text(text)
    return pkg


def uninstall(target: Path) -> Path | None:
    """Remove the shim package from ``target``; its folder, or None if there was none.
    Raises FileExistsError when ``target/mooncake`` is not ours."""
    pkg = target / "mooncake"
    if not pkg.exists():
        return None
    if not _is_ours(pkg):
        raise FileExistsError(f"{pkg} is a real mooncake install; not removing it")
    for name in _FILES:
        if _is_marked(pkg / name):  # a file of that name the shim did not write stays
            (pkg / name).unlink()
    cache = pkg / "__pycache__"
    if cache.is_dir():
        stems = {Path(name).stem for name in _FILES}
        for f in cache.iterdir():
            stem = f.name.split(".", 1)[0]
            if stem in stems and not (pkg / f"{stem}.py").exists():
                f.unlink()  # the bytecode of a module the shim wrote and removed
        try:
            cache.rmdir()
        except OSError:
            pass  # another module's bytecode stays
    try:
        pkg.rmdir()
    except OSError:
        pass  # files the shim did not write stay
    return pkg


def status(target: Path | None = None) -> str:
    """Which ``mooncake`` an ``import mooncake`` here loads, and any other one on
    ``sys.path`` (or in ``target``), in one line."""
    found: list[Path] = []
    for entry in ([str(target)] if target is not None else []) + sys.path:
        pkg = Path(entry or ".") / "mooncake"
        if pkg.is_dir() and ((pkg / "__init__.py").exists() or any(pkg.glob("store*.so"))):
            found.append(pkg.resolve())
    found = list(dict.fromkeys(found))
    spec = importlib.util.find_spec("mooncake")
    loaded = (Path(list(spec.submodule_search_locations)[0]).resolve()
              if spec is not None and spec.submodule_search_locations else None)
    if not found and loaded is None:
        return "no mooncake package on sys.path"
    if loaded is not None and loaded not in found:
        found.insert(0, loaded)
    parts = []
    for pkg in found:
        kind = "kvmaster compat shim" if _is_ours(pkg) else "real mooncake"
        how = ("loaded" if pkg == loaded else
               "not on sys.path" if str(pkg.parent) not in {str(Path(e or ".").resolve())
                                                              for e in sys.path}
               else "shadowed")
        parts.append(f"{kind} at {pkg} ({how})")
    return "; ".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("install", "uninstall", "status"),
                   help="install: write the mooncake package into the target; uninstall: "
                        "remove what install wrote there; status: which mooncake an import "
                        "loads, and any other one found")
    p.add_argument("--target", metavar="DIR", type=Path,
                   help="folder to write the mooncake package into (default: this "
                        "interpreter's site-packages)")
    p.add_argument("--shadow", action="store_true",
                   help="install: even though a real mooncake is on sys.path (never over "
                        "one: give another --target and put it first on PYTHONPATH)")


def run(args: argparse.Namespace) -> int:
    target = args.target or default_target()
    try:
        if args.action == "install":
            pkg = install(target, args.shadow)
            on_path = str(target.resolve()) in {str(Path(e or ".").resolve()) for e in sys.path}
            print(f"installed the mooncake shim at {pkg} (python: {sys.executable})"
                  + ("" if on_path else f"; {target} is not on this Python's sys.path: "
                     "add it to PYTHONPATH"))
        elif args.action == "uninstall":
            removed = uninstall(target)
            print(f"removed the mooncake shim from {removed}" if removed else
                  f"no mooncake shim in {target}")
        else:
            print(status(args.target))
    except (OSError, RuntimeError) as exc:
        print(f"kvmaster compat-shim: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser(prog="python -m kvmaster.compat.shim")
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
