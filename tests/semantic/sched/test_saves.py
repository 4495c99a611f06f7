"""SaveState: which saves still read the pool's buffers, and which the saver writes first."""

from __future__ import annotations

from semantic.sched.saves import PENDING, SAVED, SaveState


def test_a_save_reads_its_agents_buffers_from_queued_until_its_bytes_are_out():
    s = SaveState()
    n, _ = s.put("a", None, None)
    assert s.reading("a") and not s.reading("b")
    assert s.take()[0] == "a" and s.reading("a")  # being written: its views live until the bytes are out
    s.bytes_out("a")
    assert not s.reading("a") and s.outcome("a", n) == PENDING  # not durable yet
    s.done("a", ok=True)
    assert not s.reading("a") and s.outcome("a", n) == SAVED


def test_the_saver_takes_first_the_save_a_waiting_turn_needs_then_the_oldest():
    s = SaveState()
    for agent in "abc":
        s.put(agent, None, None)
    s.wanted.add("c")
    assert s.take()[0] == "c"
    s.bytes_out("c")
    assert s.wanted == set()
    s.done("c", ok=True)
    assert s.take()[0] == "a"


def test_a_failed_save_stops_reading_and_is_no_longer_wanted():
    s = SaveState()
    s.put("a", None, None)
    s.wanted.add("a")
    s.take()
    s.done("a", ok=False)  # failed before its bytes were out: the turn waiting for it goes on
    assert not s.reading("a") and s.wanted == set() and s.failed("a")
