"""Request records and trace readers for the load generator.

A trace is a list of :class:`Request` in arrival order. Each request carries the
prefix-chained block ids of its prompt (one id per KV block, e.g. 512 tokens in
the Mooncake traces).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["Request", "read_mooncake"]


@dataclass(slots=True)
class Request:
    """One inference request of a trace.

    ``timestamp_ms``: arrival time in milliseconds since the start of the trace.
    ``input_length`` / ``output_length``: prompt and generated tokens.
    ``hash_ids``: one block id per prompt block, in prompt order (prefix-chained).
    ``session``: conversation id when the trace knows it, else ``None``.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int] = field(default_factory=list)
    session: str | None = None


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
