"""Request records and trace readers for the load generator.

A trace is a list of :class:`Request` in arrival order. Each request carries the
prefix-chained block ids of its prompt (one id per KV block: 512 tokens in the
Mooncake traces, 64 in the kv-cache-tester traces).

Readers:

* :func:`read_mooncake`: Mooncake FAST'25 JSON Lines (no session ids);
* :func:`read_kvcache_tester`: kv-cache-tester JSON files, one conversation per
  file with nested sub-agents; block ids are local to a file, so they are
  namespaced by file position (see :func:`namespaced_id`);
* :func:`load_trace`: either, chosen by file name (``.jsonl`` = Mooncake,
  ``.json`` or a directory = kv-cache-tester).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "Request",
    "TRACE_FORMATS",
    "load_trace",
    "namespaced_id",
    "poisson_arrivals",
    "read_kvcache_tester",
    "read_mooncake",
    "split_trace_paths",
]

#: Values of ``--format``.
TRACE_FORMATS = ("auto", "mooncake", "kvcache-tester")
#: Bits of a namespaced id that hold the file-local id.
_LOCAL_ID_BITS = 40


@dataclass(slots=True)
class Request:
    """One inference request of a trace.

    ``timestamp_ms``: arrival time in milliseconds since the start of the trace.
    ``input_length`` / ``output_length``: prompt and generated tokens.
    ``hash_ids``: one block id per prompt block, in prompt order (prefix-chained).
    ``session``: conversation id when the trace knows it, else ``None``
    (sessions are then inferred online, see :mod:`.sessions`).
    ``block_tokens``: tokens per block (the last block may be partial).
    ``parent_session``: the conversation a sub-agent was started from.
    ``last_in_session``: the trace says this is the session's last request.
    ``stop``: why the reply to this request stopped (kv-cache-tester: ``tool_use``
    when the model called a tool, ``end_turn`` when it handed the turn back to
    the user), ``None`` when the trace does not say.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)
    session: str | None = None
    block_tokens: int = 512
    parent_session: str | None = None
    last_in_session: bool = False
    stop: str | None = None

    @property
    def full_blocks(self) -> int:
        """Leading blocks holding ``block_tokens`` tokens each (the rest is a partial block)."""
        return min(len(self.hash_ids), self.input_length // self.block_tokens)


def _int_field(obj: dict, name: str) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"field {name!r} must be an integer, got {value!r}")
    return value


def _parse_mooncake_line(line: str) -> Request:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise TypeError(f"field 'timestamp' must be a finite number, got {ts!r}")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TypeError("field 'hash_ids' must be a list of integers")
    return Request(
        timestamp_ms=float(ts),
        input_length=_int_field(obj, "input_length"),
        output_length=_int_field(obj, "output_length"),
        hash_ids=hash_ids,
    )


def read_mooncake(path: str | Path, limit: int | None = None) -> list[Request]:
    """Read a Mooncake FAST'25 JSON Lines trace.

    Each line holds ``timestamp`` (ms), ``input_length``, ``output_length`` and
    ``hash_ids``. Blank lines are skipped. ``limit`` keeps the first N requests.
    Raises ``ValueError`` naming the file and 1-based line number of a malformed
    line.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    requests: list[Request] = []
    if limit == 0:
        return requests
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_parse_mooncake_line(line))
            except (ValueError, TypeError, KeyError) as exc:
                if isinstance(exc, KeyError):
                    detail = f"missing field {exc.args[0]!r}"
                else:
                    detail = str(exc)
                raise ValueError(f"{path}:{lineno}: malformed trace line: {detail}") from exc
            if limit is not None and len(requests) >= limit:
                break
    logger.debug("read %d requests from %s", len(requests), path)
    return requests


# --------------------------------------------------------------------------- kv-cache-tester


def namespaced_id(file_no: int, local_id: int) -> int:
    """Global block id of file-local id ``local_id`` in the ``file_no``-th file (0-based)."""
    if not 0 <= local_id < (1 << _LOCAL_ID_BITS):
        raise ValueError(f"hash id {local_id} out of range [0, 2**{_LOCAL_ID_BITS})")
    return ((file_no + 1) << _LOCAL_ID_BITS) | local_id


def _number(obj: dict, name: str, default: float | None = None) -> float:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"field {name!r} must be a finite number, got {value!r}")
    return float(value)


def _conversation(doc: Any, file_no: int, offset_s: float, name: str) -> list[Request]:
    """Requests of one kv-cache-tester file (main thread and sub-agents, any depth)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise TypeError("expected an object with a 'requests' list")
    block_tokens = int(_number(doc, "block_size", 64))
    if block_tokens <= 0:
        raise ValueError(f"block_size must be > 0, got {block_tokens}")
    out: list[Request] = []

    def walk(items: list, session: str, parent: str | None, base_s: float) -> None:
        mine: list[Request] = []
        for item in items:
            if not isinstance(item, dict):
                raise TypeError(f"request of {session} is not an object")
            t = base_s + _number(item, "t")
            if item.get("type") == "subagent":
                sub = f"{session}/{item.get('agent_id', len(out))}"
                walk(item.get("requests") or [], sub, session, t)
                continue
            ids = item.get("hash_ids", [])
            if not isinstance(ids, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) for h in ids):
                raise TypeError(f"hash_ids of a request of {session} must be a list of integers")
            stop = item.get("stop")
            req = Request(timestamp_ms=(offset_s + t) * 1000.0,
                          input_length=int(_number(item, "in")),
                          output_length=int(_number(item, "out", 0)),
                          hash_ids=[namespaced_id(file_no, h) for h in ids],
                          session=session, block_tokens=block_tokens, parent_session=parent,
                          stop=stop if isinstance(stop, str) and stop else None)
            mine.append(req)
        if mine:
            max(mine, key=lambda r: r.timestamp_ms).last_in_session = True
        out.extend(mine)

    walk(doc["requests"], str(doc.get("id") or name), None, 0.0)
    return out


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Start times in seconds of ``n`` conversations arriving as a Poisson process.

    Gaps are independent exponentials of mean ``1 / rate_per_s`` drawn from
    ``random.Random(seed)``; the first conversation starts one gap after 0.
    The same ``(n, rate_per_s, seed)`` always gives the same list, and a longer
    list extends a shorter one.  Raises ``ValueError`` unless ``rate_per_s`` is
    a finite number > 0.
    """
    if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
        raise ValueError(f"arrival rate must be a finite number > 0, got {rate_per_s}")
    rng = random.Random(seed)
    t = 0.0
    out: list[float] = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def read_kvcache_tester(paths: list[str | Path], limit: int | None = None,
                        stagger_s: float = 60.0, arrival_rate: float | None = None,
                        seed: int = 0) -> list[Request]:
    """Read kv-cache-tester conversations (one JSON file each) into one arrival-ordered trace.

    Conversation ``n`` (0-based, in the order given) starts ``n * stagger_s``
    seconds into the trace or, with ``arrival_rate`` (conversations per trace
    second), at the ``n``-th time of :func:`poisson_arrivals` with ``seed``;
    inside a conversation the request times ``t`` are kept (so are its think
    times), a sub-agent's times are added to its marker's ``t``. Each file's main
    thread is one session (the file ``id``) and each sub-agent another one
    (``id/agent_id``, ``parent_session`` = the thread that started it). Block
    ids are namespaced with :func:`namespaced_id` by file position. ``limit``
    keeps the first N requests of the merged trace. Raises ``ValueError``
    naming the file on malformed input.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not (stagger_s >= 0 and math.isfinite(stagger_s)):
        raise ValueError(f"stagger_s must be a finite number >= 0, got {stagger_s}")
    paths = [Path(p) for p in paths]
    starts = (poisson_arrivals(len(paths), arrival_rate, seed) if arrival_rate is not None
              else [n * stagger_s for n in range(len(paths))])
    merged: list[tuple[float, int, int, Request]] = []
    for file_no, path in enumerate(paths):
        with path.open("r", encoding="utf-8") as fh:
            try:
                doc = json.load(fh)
                reqs = _conversation(doc, file_no, starts[file_no], path.stem)
            except (ValueError, TypeError, KeyError) as exc:
                detail = f"missing field {exc.args[0]!r}" if isinstance(exc, KeyError) else exc
                raise ValueError(f"{path}: malformed kv-cache-tester trace: {detail}") from exc
        merged.extend((r.timestamp_ms, file_no, i, r) for i, r in enumerate(reqs))
    merged.sort(key=lambda x: x[:3])
    requests = [r for *_, r in merged]
    if limit is not None:
        requests = requests[:limit]
    logger.debug("read %d requests from %d kv-cache-tester files", len(requests), len(paths))
    return requests


# --------------------------------------------------------------------------- any trace


def split_trace_paths(spec: str) -> list[Path]:
    """Paths of a ``trace`` setting: several are joined by ``os.pathsep``; a directory
    stands for its ``*.json`` files (sorted by name)."""
    out: list[Path] = []
    for part in filter(None, spec.split(os.pathsep)):
        p = Path(part)
        if p.is_dir():
            files = sorted(p.glob("*.json"))
            if not files:
                raise ValueError(f"{p}: no *.json trace files in this directory")
            out.extend(files)
        else:
            out.append(p)
    if not out:
        raise ValueError("no trace path given")
    return out


def load_trace(spec: str, fmt: str = "auto", limit: int | None = None,
               stagger_s: float = 60.0, arrival_rate: float | None = None,
               seed: int = 0) -> list[Request]:
    """Read the trace(s) named by ``spec`` (see :func:`split_trace_paths`).

    ``fmt``: ``mooncake`` (one ``.jsonl`` file), ``kvcache-tester`` (``.json``
    files) or ``auto`` (by extension).  ``stagger_s``, ``arrival_rate`` and
    ``seed`` place kv-cache-tester conversations (see
    :func:`read_kvcache_tester`).  Raises ``ValueError`` on a mix, an unknown
    format or an arrival rate for a Mooncake trace (its requests keep their
    own times), ``OSError`` when a file cannot be read.
    """
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(TRACE_FORMATS)}, got {fmt!r}")
    paths = split_trace_paths(spec)
    if fmt == "auto":
        kinds = {"mooncake" if p.suffix == ".jsonl" else "kvcache-tester" for p in paths}
        if len(kinds) != 1:
            raise ValueError("cannot mix Mooncake (.jsonl) and kv-cache-tester (.json) traces")
        fmt = kinds.pop()
    if fmt == "mooncake":
        if len(paths) != 1:
            raise ValueError(f"a Mooncake replay takes one trace file, got {len(paths)}")
        if arrival_rate is not None:
            raise ValueError("an arrival rate applies to kv-cache-tester conversations; a "
                             "Mooncake trace keeps its own arrival times")
        return read_mooncake(paths[0], limit)
    return read_kvcache_tester(paths, limit, stagger_s, arrival_rate, seed)
