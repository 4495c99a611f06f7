"""The engine's named errors as the API answers them."""

from __future__ import annotations

from semantic import PoolExhaustedError, TurnTooLargeError
from semantic.serve.errors import from_semantic


def test_a_turn_no_wait_can_fit_is_a_400_with_its_numbers_and_a_full_pool_a_503_to_retry():
    too = from_semantic(TurnTooLargeError("this turn needs up to 2.0 GiB of the KV pool but the pool has 1.0 GiB"))
    assert too.status_code == 400 and "2.0 GiB" in too.message and "1.0 GiB" in too.message
    assert "Retry-After" not in (too.headers or {})  # no retry can fix it
    full = from_semantic(PoolExhaustedError("no free blocks now"))
    assert full.status_code == 503 and full.headers["Retry-After"] == "1"
