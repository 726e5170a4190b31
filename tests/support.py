"""Helpers the test files share (fixtures stay in conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], object], timeout: float, what: str,
               step: float = 0.02) -> float:
    """Poll ``pred`` every ``step`` s until it is true; returns the seconds it took.
    Fails (AssertionError naming ``what``) after ``timeout`` s."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)
    return time.monotonic() - t0
