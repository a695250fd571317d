"""Bounded waits for tests: what a worker thread does after the test's own code has moved on
(a cancel taken up at the engine's next step, memory handed back once idle) is polled for, with
a deadline, never slept for."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(condition: Callable[[], bool], seconds: float = 10) -> bool:
    """Whether `condition()` holds within `seconds`, polled every 10 ms."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
