"""Engines stepping at once in one process call OpenBLAS single-threaded; one alone gets all its threads."""

from __future__ import annotations

import threading

from semantic.blasshare import BlasShare


def test_a_second_executor_stepping_sets_one_thread_and_the_last_one_left_gets_them_all_back():
    calls = []
    share = BlasShare(setter=calls.append, getter=lambda: 4)
    with share.stepping():
        assert calls == []                      # alone: as a server of one model
        with share.stepping():
            assert calls == [1]                 # two at once: one thread each, no shared GEMM lock
            with share.stepping():
                assert calls == [1]
        assert calls == [1, 4]                  # one left: all four again
    assert calls == [1, 4]


def test_steps_from_many_threads_leave_the_count_at_zero_and_the_threads_full():
    calls = []
    share = BlasShare(setter=calls.append, getter=lambda: 2)
    start = threading.Barrier(8)

    def worker():
        start.wait()
        for _ in range(200):
            with share.stepping():
                pass

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert share._active == 0 and (not calls or calls[-1] == 2)


def test_without_openblas_in_the_process_stepping_changes_nothing(monkeypatch):
    from semantic import blasshare

    monkeypatch.setattr(blasshare, "_openblas", lambda: (None, None))
    share = BlasShare()
    with share.stepping(), share.stepping():
        pass
    assert share._active == 0
