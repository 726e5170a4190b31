"""Stand-in for the third-party ``regex`` module: the stdlib ``re`` calls vLLM's
Mooncake set-up uses (``match`` on an ASCII pattern, where both modules agree)."""

from re import IGNORECASE, compile, fullmatch, match, search  # noqa: F401
