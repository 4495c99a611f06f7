"""The step planner's rules on plain values: admission, room-making, the RAM budget, cancels. No threads, no model.

The planner reads a cache only through ``unique_blocks()`` and each block's
``nbytes`` (``semantic.sched.residency``), so the caches here are small stand-ins
with exactly that: what is tested is which agent goes, not MLX.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from semantic import PoolExhaustedError, Request, TurnTooLargeError
from semantic.sched.planner import StepPlanner, Ticket
from semantic.sched.residency import DistinctBytes, Residency


@dataclass(eq=False)
class Block:
    nbytes: int


class Cache:
    """Stands in for AgentBlocks: the blocks it references."""

    def __init__(self, *blocks: Block):
        self.blocks = blocks

    def unique_blocks(self):
        return list(self.blocks)


def ticket(agent: str, max_tokens: int = 4) -> Ticket:
    return Ticket(Request(agent, [1, 2, 3], max_tokens), Future())


def planner(capacity=100, max_batch=8, budget=None) -> StepPlanner:
    return StepPlanner(max_batch=max_batch, max_queued=16, capacity=capacity, budget=budget)


def saved(p: StepPlanner, agent: str, cache: Cache) -> None:
    """Make ``cache`` the agent's resident cache, already on disk."""
    p.residency.put(agent, cache)


def unsaved(p: StepPlanner, agent: str, cache: Cache) -> None:
    """Make ``cache`` resident with its save pending."""
    p.residency.put(agent, cache)
    p.saves.put(agent, cache, prepared=None)


def test_admission_reserves_blocks_and_later_turns_wait_for_a_finish():
    p = planner(capacity=10)
    a, b, c = ticket("a"), ticket("b"), ticket("c")
    for t in (a, b, c):
        p.enqueue(t)
    plan = p.plan(free=10, needs={a: 4, b: 4, c: 4})
    assert plan.admit == [(a, 4), (b, 4)] and not plan.evict and not plan.wait_for_save and not plan.fail
    p.started(a, 0, 4)
    p.started(b, 1, 4)
    # with turns in flight, c waits: nothing is evicted for it
    saved(p, "old", Cache(Block(10)))
    assert not p.plan(free=2, needs={c: 4})


def test_with_nothing_in_flight_the_least_recently_used_saved_cache_is_evicted_first():
    p = planner(capacity=10)
    saved(p, "x", Cache(Block(1)))
    saved(p, "y", Cache(Block(1)))
    t = ticket("a")
    p.enqueue(t)
    assert p.plan(free=1, needs={t: 4}).evict == "x"
    assert p.own_cache("x") is not None  # x's turn read its cache: y is now the older
    assert p.plan(free=1, needs={t: 4}).evict == "y"


def test_an_agents_own_cache_is_never_evicted_to_make_room_and_a_cache_being_saved_is_waited_for():
    p = planner(capacity=10)
    saved(p, "a", Cache(Block(1)))       # the waiting turn's own cache
    unsaved(p, "pending", Cache(Block(1)))
    t = ticket("a")
    p.enqueue(t)
    plan = p.plan(free=1, needs={t: 4})
    assert plan.evict is None and plan.wait_for_save  # only the save under way can help
    p.saves.take()
    p.saves.done("pending", ok=False)     # the save failed: now only dropping it, unsaved, can help
    plan = p.plan(free=1, needs={t: 4})
    assert plan.evict == "pending" and p.saves.lost == 1
    p.drop("pending")
    plan = p.plan(free=1, needs={t: 4})
    assert plan.admit == [] and plan.evict is None and not plan.wait_for_save
    (failed, exc), = plan.fail
    assert failed is t and isinstance(exc, PoolExhaustedError) and "busy or not yet saved" in str(exc)


def test_a_cache_whose_save_failed_is_dropped_for_room_only_after_every_saved_one_and_never_while_it_runs():
    p = planner(capacity=10)
    unsaved(p, "failed", Cache(Block(1)))
    p.saves.take()
    p.saves.done("failed", ok=False)
    saved(p, "saved", Cache(Block(1)))
    t = ticket("a")
    p.enqueue(t)
    assert p.plan(free=1, needs={t: 4}).evict == "saved" and p.saves.lost == 0
    p.drop("saved")
    busy = ticket("failed")
    p.enqueue(busy)
    p.started(busy, 7, 1)                 # its turn runs: it may not go (a turn's finish frees blocks)
    assert p.make_room(exclude="a") is None and not p.plan(free=1, needs={t: 4}) and p.saves.lost == 0


def test_a_turn_larger_than_the_pool_fails_at_once_and_the_next_is_admitted():
    p = planner(capacity=8)
    big, small = ticket("big"), ticket("small")
    p.enqueue(big)
    p.enqueue(small)
    plan = p.plan(free=8, needs={big: 9, small: 3})
    assert [t for t, _ in plan.fail] == [big]
    err = plan.fail[0][1]  # no wait fits it: a 400 with the numbers, not a 503 to retry
    assert isinstance(err, TurnTooLargeError) and isinstance(err, PoolExhaustedError)
    assert "9 B" in str(err) and "has 8 B" in str(err) and "larger pool" in str(err)
    assert plan.admit == [(small, 3)]


def test_a_turn_joining_others_reserves_what_the_merged_batch_grows_by_and_alone_nothing():
    p = planner(capacity=100)
    a, b, c = ticket("a"), ticket("b"), ticket("c")
    for t in (a, b, c):
        p.enqueue(t)
    # alone, a decodes in its own buffers; b joining makes a batch of two rows padded to the longer (2 x 20)
    plan = p.plan(free=100, needs={a: 5, b: 5, c: 5}, rows={a: 20, b: 10, c: 10})
    assert plan.admit == [(a, 5), (b, 5 + 40), (c, 5 + 20)]
    p.started(a, 0, 5, 20)
    # with a in flight, b's join costs the whole merged batch; 40 + 5 > 30 free: it waits for a finish
    plan = p.plan(free=30, needs={b: 5}, rows={b: 10})
    assert not plan.admit and not plan.fail and not plan.evict


def test_the_batch_bound_limits_admissions_and_heads():
    p = planner(max_batch=2)
    ts = [ticket(f"a{i}") for i in range(3)]
    for t in ts:
        p.enqueue(t)
    assert p.heads() == ts
    assert [t for t, _ in p.plan(free=100, needs={t: 1 for t in ts}).admit] == ts[:2]
    p.started(ts[0], 0, 1)
    p.started(ts[1], 1, 1)
    assert p.heads() == []


def test_an_agents_turns_start_one_at_a_time_in_order():
    p = planner()
    first, second = ticket("a"), ticket("a")
    p.enqueue(first)
    p.enqueue(second)
    assert p.heads() == [first]
    p.started(first, 7, 2)
    assert p.heads() == [] and p.queued == 1 and p.pinned("a")
    done = _completion(first.request, 7)
    got, replaced = p.finish(7, done, Cache(Block(3)), prepared=None)
    assert got is first and replaced == [None]
    assert p.heads() == [second] and p.residency.bytes == 3


def test_cancel_takes_a_queued_turn_off_its_queue_and_marks_a_running_one():
    p = planner()
    running, queued = ticket("a"), ticket("b")
    p.enqueue(running)
    p.enqueue(queued)
    p.started(running, 0, 1)
    assert p.cancel(queued.future) is queued and p.queued == 0 and p.heads() == []
    assert p.cancel(running.future) is True and p.cancelled() == [0]
    assert p.cancel(Future()) is False
    assert p.counts["cancelled"] == 1  # the running one counts when it finishes


def test_a_ticket_cancelled_while_being_admitted_ends_at_the_next_step():
    p = planner()
    t = ticket("a")
    p.enqueue(t)
    assert p.heads() == [t]
    assert p.cancel(t.future) is t     # cancel() lands between the plan and the start
    p.started(t, 3, 1)
    assert p.cancelled() == [3] and p.queued == 0


def test_the_budget_evicts_saved_caches_first_then_waits_for_saves_then_drops_unsaved_ones_as_lost():
    p = planner(budget=10)
    shared = Block(4)
    saved(p, "x", Cache(shared, Block(4)))
    saved(p, "y", Cache(shared, Block(4)))  # the shared block counts once: 12 bytes
    unsaved(p, "z", Cache(Block(4)))        # 16 bytes
    assert p.residency.bytes == 16
    assert p.plan_budget().evict == "x"
    p.drop("x")
    assert p.residency.bytes == 12 and p.plan_budget().evict == "y"
    p.drop("y")
    assert p.residency.bytes == 4 and not p.plan_budget()  # within the budget
    unsaved(p, "w", Cache(Block(8)))        # 12 bytes, only unsaved caches left
    assert p.plan_budget().wait_for_save
    p.saves.take()
    p.saves.done("z", ok=False)
    p.saves.take()
    p.saves.done("w", ok=False)             # nothing can be saved: the memory bound wins
    assert p.plan_budget().evict == "z" and p.saves.lost == 1
    p.drop("z")
    assert p.residency.bytes == 8 and not p.plan_budget() and p.counts["over_budget_steps"] == 0
    assert not p.saves.unsaved("z") and p.saves.unsaved("w")
    assert (p.counts["budget_evictions"], p.counts["budget_waits"], p.counts["evictions"]) == (3, 1, 3)


def test_distinct_bytes_count_a_shared_block_once_and_match_a_recount():
    shared = Block(5)
    a, b = Cache(shared, Block(1)), Cache(shared, Block(2))
    d = DistinctBytes()
    d.add(a)
    d.add(b)
    assert d.bytes == 8 == DistinctBytes.of([a, b])
    d.remove(a)
    assert d.bytes == 7 == DistinctBytes.of([b])
    r = Residency()
    r.put("a", a)
    assert r.put("a", b) is a and r.bytes == 7 and r.recount() == 7


def _completion(request: Request, uid: int):
    from semantic import Completion

    return Completion(request=request, uid=uid, token_ids=[5], logprobs=[0.0], finish_reason="length",
                      cached_tokens=0, reuse="none", blocks=None)
