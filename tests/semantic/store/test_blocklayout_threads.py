"""The block layout under threads: saves of agents that share block files, beside collection."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path

import numpy as np
import pytest

from semantic.store import blocklayout
from tests.cache_helpers import assert_identical, make_executor, generate, history
from tests.semantic.store.test_blocklayout import SYSTEM, _kvbs, _manifest, _names, _store

pytestmark = pytest.mark.compat


def test_threads_saving_agents_on_one_prompt_leave_every_manifest_whole_and_nothing_unnamed(llama_tiny, tmp_path):
    executor = make_executor(llama_tiny, blocks=1024)
    turns = {a: [generate(executor, a, [*SYSTEM, *history(3 + 2 * t, seed=10 * i + t)], 2).blocks for t in range(3)]
             for i, a in enumerate("abcd")}  # each turn another history on the prompt: its files replace the last's
    store = _store(executor, tmp_path)
    errors = []

    def worker(a, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(8):
                store.save(a, turns[a][int(rng.integers(0, 3))])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append("".join(traceback.format_exception(exc)))

    threads = [threading.Thread(target=worker, args=(a, i)) for i, a in enumerate("abcd")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors[0]
    named = set().union(*(_names(_manifest(tmp_path, executor.spec, a)) for a in store.agents()))
    assert set(_kvbs(tmp_path)) == named and list(tmp_path.rglob("*.tmp")) == []
    again = _store(make_executor(llama_tiny, blocks=1024), tmp_path)
    assert again.stats().collected == 0 and again.agents() == list("abcd")
    for a in again.agents():
        tokens = _manifest(tmp_path, executor.spec, a).token_ids
        assert_identical(again.load(a), next(c for c in turns[a] if c.token_ids == tokens))


def test_a_block_file_written_again_while_the_collector_deletes_its_old_copy_survives(llama_tiny, tmp_path, monkeypatch):
    executor = make_executor(llama_tiny)
    c = generate(executor, "x", [*SYSTEM, *history(5)], 2).blocks
    store = _store(executor, tmp_path)
    store.save("x", c)
    taken, written = threading.Event(), threading.Event()
    real = blocklayout.atomic.unlink_quietly

    def unlink(path):  # the collector, between dropping x's files from the index and deleting the first
        if Path(path).suffix == ".kvb" and not Path(path).name.startswith(".") and not taken.is_set():
            taken.set()
            written.wait(3)  # a collector that keeps saves out meanwhile (a fix) goes on after 3 s
        real(path)

    monkeypatch.setattr(blocklayout.atomic, "unlink_quietly", unlink)
    deleting = threading.Thread(target=store.delete, args=("x",))
    deleting.start()
    assert taken.wait(10)
    try:
        store.save("y", c)  # the same history under another agent: every file is planned anew
    finally:
        written.set()
        deleting.join()
    assert _names(_manifest(tmp_path, executor.spec, "y")) <= set(_kvbs(tmp_path))
    assert_identical(_store(make_executor(llama_tiny), tmp_path).load("y"), c)
