"""The documentation's relative links resolve, and the pages say what the code does.

Every relative markdown link in README.md, docs/*.md, BENCHMARKS.md, RELIABILITY.md, HA.md
and protocol/*.md must name an existing file, and a ``#fragment`` must name a heading of
that file (GitHub's anchor rules).  docs/operating.md must list every flag of
``MasterConfig``, and the README's first two commands must be the two scripts CI runs.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from pathlib import Path

import pytest

from kvmaster.config import MasterConfig

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted({REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "RELIABILITY.md",
                REPO / "HA.md", *REPO.glob("docs/*.md"), *REPO.glob("protocol/*.md")})

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, as (line number, text)."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LN" or cat == "Mn":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        anchors.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return anchors


def _links(page: Path) -> list[tuple[int, str]]:
    out = []
    for n, line in _prose_lines(page.read_text(encoding="utf-8")):
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            out.append((n, m.group(1)))
    return out


def test_pages_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/client.md", "docs/operating.md",
            "BENCHMARKS.md", "RELIABILITY.md", "protocol/PROTOCOL.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for line, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.name}:{line}: {target} (no such file)")
            continue
        if fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{page.name}:{line}: {target} (no heading #{fragment})")
    assert not broken, "\n".join(broken)


def test_slug_follows_github():
    assert _slug("Data path: same host, 64 blocks per batch / pipeline") == \
        "data-path-same-host-64-blocks-per-batch--pipeline"
    assert _slug("After a restart: `on_reconnect`") == "after-a-restart-on_reconnect"
    assert _slug("18. Bounds and back-pressure") == "18-bounds-and-back-pressure"


def test_operating_page_lists_every_master_flag():
    text = (REPO / "docs" / "operating.md").read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(MasterConfig)
               if f"`--{f.name.replace('_', '-')}`" not in text]
    assert not missing, f"flags of MasterConfig not in docs/operating.md: {missing}"


def test_readme_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README has no bash block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert commands[:2] == ["scripts/run.sh", "scripts/test.sh"]
    for script in commands[:2]:
        assert (REPO / script).is_file()
