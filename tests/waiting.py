"""Polling a condition until it holds, for the tests that drive real processes."""

from __future__ import annotations

import time


def wait_for(what: str, check, timeout: float, interval: float = 0.5):
    """Calls ``check`` until it returns something truthy and returns that value; raises
    AssertionError naming ``what`` once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
