"""Process-wide logging for the ``kvmaster`` commands: levels and line format by flag.

Library modules only create their logger (``logging.getLogger(__name__)``) and
log with ``%s`` arguments; the command that starts a process calls
:func:`configure_logging` once.  Two formats:

* ``text``: ``2026-01-02 03:04:05,678 INFO kvmaster.master [master] listening ...``
* ``json``: one object per line with ``ts`` (UTC, ISO 8601), ``level``,
  ``logger``, ``thread``, ``msg`` and, for exceptions, ``exc``; log shippers
  read it without a parsing rule.

Per-logger levels (``--log-levels kvmaster._shard=DEBUG``) turn on one
module's debug lines without flooding the rest.  Hot paths guard their debug
calls with ``isEnabledFor`` so a level that is off costs one attribute check.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

from kvmaster.config import LOG_LEVELS, parse_log_levels

__all__ = ["JsonFormatter", "configure_logging", "configure_logging_from_config"]

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Attributes every LogRecord has; anything else came in through ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; keys passed with ``extra=`` are kept."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "thread": record.threadName,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and k not in out:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text", levels: str = "",
                      stream: TextIO | None = None) -> logging.Handler:
    """Send log records of this process to ``stream`` (stderr) in ``fmt``.

    ``level`` applies to the root logger, ``levels`` (``"name=LEVEL,..."``) to
    single loggers.  Replaces handlers installed by an earlier call, so it is
    safe to call again (tests do).  Returns the handler.
    """
    level = level.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    per_logger = parse_log_levels(levels)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    handler._kvmaster = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_kvmaster", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name, lvl in per_logger.items():
        logging.getLogger(name).setLevel(lvl)
    return handler


def configure_logging_from_config(config: Any) -> logging.Handler:
    """:func:`configure_logging` from a config with ``log_level``, ``log_format`` and
    ``log_levels`` fields (``MasterConfig``)."""
    return configure_logging(config.log_level, config.log_format, config.log_levels)
