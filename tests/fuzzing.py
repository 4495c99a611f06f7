"""How many cases a fuzzer tries: a sample in ``make test``, the full count in ``make test-slow``.

``make test-slow`` sets ``SEMANTIC_FUZZ=full`` and runs every test marked
``fuzz`` again with its full count (CI runs both), so the quick suite keeps
each fuzzer's every shape of input while the thorough one keeps its numbers.
"""

from __future__ import annotations

import os

FULL = os.environ.get("SEMANTIC_FUZZ") == "full"


def cases(full: int, quick: int) -> int:
    """``full`` under ``SEMANTIC_FUZZ=full``, else ``quick``."""
    return full if FULL else quick
