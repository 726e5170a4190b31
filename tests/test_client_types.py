"""The clients' operations have their real signatures for a type checker.

The operations are installed on ``Client`` and ``AsyncClient`` by a loop at import;
``tools/gen_client_types.py`` writes their typed signatures into
``kvmaster/_client/typed_sync.py`` and ``typed_async.py``, whose classes the clients
inherit from for a type checker.  This checks the written modules are those the tool
writes now, and that mypy sees what a user's code gets back (bytes, not a generator); and that mypy
finds nothing in the whole package (strict on the public modules)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tools import gen_client_types

REPO = Path(__file__).resolve().parents[1]


def test_generated_signatures_are_up_to_date() -> None:
    assert gen_client_types.main(["--check"]) == 0, \
        "run python -m tools.gen_client_types after changing an operation in kvmaster/_client/"


def test_a_type_checker_sees_the_results(tmp_path: Path) -> None:
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent("""
        from kvmaster import AsyncClient, Client

        def sync(c: Client) -> None:
            reveal_type(c.get("k"))
            reveal_type(c.put_batch(["k"], [b"v"]))
            reveal_type(c.get_batch(["k"]))
            c.put("k", 1)

        async def aio(a: AsyncClient) -> None:
            reveal_type(await a.get_kv_session("s"))
    """))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary",
         "--cache-dir", str(tmp_path / "cache"), str(user)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "MYPYPATH": str(REPO)}).stdout
    notes = [line.split("note: ", 1)[1] for line in out.splitlines() if "note: " in line]
    assert notes == ['Revealed type is "bytes"', 'Revealed type is "list[int]"',
                     'Revealed type is "list[bytes | None]"',
                     'Revealed type is "kvmaster._client.records.KvSessionInfo"'], out
    assert 'Argument 2 to "put" of "Client" has incompatible type "int"' in out, out


def test_the_lazy_public_names_are_all_imported_for_a_type_checker() -> None:
    import kvmaster

    text = (REPO / "kvmaster" / "__init__.py").read_text(encoding="utf-8")
    typed = text.split("if TYPE_CHECKING:", 1)[1].split("\n\n", 1)[0]
    missing = [n for n in kvmaster._LAZY if n not in re.findall(r"\w+", typed)]
    assert not missing, f"add to the TYPE_CHECKING imports of kvmaster/__init__.py: {missing}"


#: The modules a user imports: ``mypy --strict`` finds nothing in them.
PUBLIC = ["kvmaster/__init__.py", "kvmaster/client.py", "kvmaster/aio.py",
          "kvmaster/errors.py", "kvmaster/config.py", "kvmaster/compat/__init__.py"]


def test_the_public_modules_pass_mypy_strict(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         "--cache-dir", str(tmp_path / "cache"), *PUBLIC],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]


def test_the_whole_package_passes_mypy(tmp_path: Path) -> None:
    """``mypy kvmaster`` with the project's settings (pyproject.toml) finds nothing."""
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "kvmaster"],
        capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
