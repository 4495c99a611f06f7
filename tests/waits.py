"""Waiting for a condition, never for a time: a bounded poll with a generous ceiling.

A test that sleeps a fixed time and then asserts fails on a busy machine; one that polls for what
it needs only runs slower there.
"""

from __future__ import annotations

import time
from typing import Callable


def until(cond: Callable[[], object], timeout_s: float = 60.0, every_s: float = 0.02) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def wait_for(cond: Callable[[], object], what: Callable[[], object] = lambda: "", timeout_s: float = 60.0) -> None:
    """Poll ``cond`` until it holds; past ``timeout_s``, fail with what ``what()`` says of the state."""
    if not until(cond, timeout_s):
        raise AssertionError(f"not within {timeout_s:.0f} s: {what()}")
