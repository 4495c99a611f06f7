"""A real ``redis-server`` on 127.0.0.1 for the shared tier's tests (skipped, with the reason, without one).

The process is the experiment's (``harness.trials.shared_tier.redis_server``); a machine without the binary
skips instead of failing.
"""

from __future__ import annotations

import pytest

from harness.trials.shared_tier import redis_server


class RedisServer(redis_server.RedisServer):
    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        try:
            return super().start(timeout_s)
        except redis_server.RedisMissing as exc:
            pytest.skip(str(exc))
