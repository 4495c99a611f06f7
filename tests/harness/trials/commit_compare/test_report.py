"""EXP-022's verdicts from paired rows (``harness.trials.commit_compare.report``), on stated numbers."""

from __future__ import annotations

import numpy as np

from harness.trials.commit_compare import report


def _rows(kind: str, new: list[float], old: list[float], field: str = "ttft_s") -> list[dict]:
    rows = []
    for pair, (n, o) in enumerate(zip(new, old)):
        rows += [{"server": "new", "kind": kind, "pair": pair, field: n, "error": None},
                 {"server": "old", "kind": kind, "pair": pair, field: o, "error": None}]
    return rows


def test_pairs_match_each_step_s_two_sides_and_skip_a_failed_side():
    rows = _rows("append", [1.0, 2.0, 3.0], [1.0, 1.0, 1.0])
    rows[2]["error"] = "boom"  # pair 1's new side failed: no pair
    assert report.pairs(rows, "new", "old", "append", "ttft_s") == [(1.0, 1.0), (3.0, 1.0)]


def test_a_shift_beyond_the_noise_is_slower_and_jitter_around_one_is_noise():
    rng = np.random.default_rng(1)
    old = list(1 + 0.02 * rng.standard_normal(12))
    slower = report.summarize([1.2 * o / o2 for o, o2 in zip(old, rng.permutation(old))], tolerance=0.03)
    same = report.summarize([o / o2 for o, o2 in zip(old, rng.permutation(old))], tolerance=0.03)
    assert slower["verdict"] == "slower" and slower["low"] > 1.03 and slower["p"] < 0.01
    assert same["verdict"] == "noise" and same["low"] < 1 < same["high"]
    faster = report.summarize([0.8] * 6, tolerance=0.03)
    assert faster["verdict"] == "faster" and faster["ratio"] == 0.8


def test_an_interval_above_the_tolerance_without_a_significant_test_is_noise():
    s = report.summarize([1.07, 1.05, 1.30, 1.45, 1.06], tolerance=0.03)   # a commit against itself, once
    assert s["low"] > 1.03 and s["p"] > report.SIGNIFICANCE and s["verdict"] == "noise"


def test_too_few_pairs_give_an_interval_but_no_verdict():
    s = report.summarize([1.5, 1.6, 1.4], tolerance=0.03)
    assert s["verdict"] == "few pairs" and s["pairs"] == 3 and s["ratio"] == 1.5


def test_the_table_reads_decode_rows_as_a_pace_and_turns_as_ttft_and_total():
    rows = _rows("first", [2.0] * 6, [1.0] * 6)
    for r in rows:
        r["total_s"] = 3.0 if r["server"] == "new" else 2.0
    rows += _rows("decode_b1", [0.05] * 6, [0.1] * 6, "pace_s")
    t = report.table(rows, "new", "old", 0.03)
    assert set(t) == {"first", "decode_b1"} and set(t["decode_b1"]) == {"pace"}
    assert t["first"]["ttft"]["ratio"] == 2.0 and t["first"]["total"]["ratio"] == 1.5
    assert t["decode_b1"]["pace"]["verdict"] == "faster"
    c = report.checks({"models": {"m": {"rows": rows, "table": t}}, "failed": []}, 0.03)
    assert c["slower_count"] == 2 and c["slower"] == ["m first ttft 2.000x", "m first total 1.500x"]
    assert c["faster"] == ["m decode_b1 pace 0.500x"] and c["errors"] == 0
