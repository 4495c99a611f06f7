"""EXP-017's pure parts without a server: /proc/<pid>/io, KV bytes per token, the ratios, a cache directory's
bytes, the checks from the phases' rows, and that every criterion of the TOML names a check the kind writes."""

from __future__ import annotations

import os

import pytest

from harness.config import ConfigError, load
from harness.criteria import resolve
from harness.prompts import shared_prefix
from harness.trials.block_store import measure
from harness.trials.block_store.checks import all_checks, beside_checks, replies_differing, restart_checks, write_amp_checks
from harness.trials.block_store.servers import evict_page_cache, layout_args

PROC_IO = """rchar: 6976
wchar: 120
syscr: 10
syscw: 2
read_bytes: 4096
write_bytes: 58478592
cancelled_write_bytes: 12288
"""
# SmolLM2-135M f32 as a server's /v1/cache/stats reports it: 91 blocks of 256 tokens in 1073 MB
SMOLLM2_STATS = {"pool": {"total_blocks": 91, "used_blocks": 11, "block_tokens": 256, "capacity_bytes": 1073479680}}


def test_proc_io_text_parses_to_its_counters():
    io = measure.parse_proc_io(PROC_IO)
    assert io["write_bytes"] == 58478592 and io["cancelled_write_bytes"] == 12288 and io["wchar"] == 120
    before = dict(io, write_bytes=1000, wchar=20)
    assert measure.io_delta(before, io)["write_bytes"] == 58477592
    assert measure.io_delta(before, io)["wchar"] == 100


def test_a_text_without_the_write_counters_is_refused():
    with pytest.raises(ValueError, match="write_bytes"):
        measure.parse_proc_io("rchar: 1\nwchar: 2\n")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="no /proc/<pid>/io on this system")
def test_this_process_io_counts_a_synced_write(tmp_path):
    before = measure.read_proc_io(os.getpid())
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * (1 << 20))
        f.flush()
        os.fsync(f.fileno())
    after = measure.read_proc_io(os.getpid())
    delta = measure.io_delta(before, after)
    assert delta["wchar"] >= 1 << 20
    # write_bytes is charged on block-backed filesystems only (a tmpfs counts none)
    assert delta["write_bytes"] == 0 or delta["write_bytes"] >= 1 << 20


def test_kv_bytes_per_token_from_the_pool_capacity_or_a_direct_field():
    assert measure.kv_bytes_per_token(SMOLLM2_STATS) == 46080   # 30 layers x 3 heads x 64 x K,V x 4 B
    assert measure.kv_bytes_per_token({"pool": {**SMOLLM2_STATS["pool"], "kv_bytes_per_token": 20480}}) == 20480
    with pytest.raises(ValueError):
        measure.kv_bytes_per_token({"pool": {"total_blocks": 0, "block_tokens": 256, "capacity_bytes": 0}})


def test_write_amplification_is_bytes_written_over_the_kv_the_turn_added():
    added = measure.added_tokens(prompt_tokens=3410, cached_tokens=3319, completion_tokens=17)
    assert added == 107                               # the reply's last token is never fed
    # issue 38's first row: 157.9 MB written for 107 tokens at 46 KB each
    assert measure.write_amplification(157_900_000, added, 46080) == pytest.approx(32.02, abs=0.01)
    assert measure.write_amplification(107 * 46080, added, 46080) == 1.0
    assert measure.added_tokens(100, 120, 5) == 4     # a prompt shorter than what was cached adds its reply only
    with pytest.raises(ValueError):
        measure.write_amplification(1, 0, 46080)


def test_summaries_and_ratios_of_medians():
    assert measure.summary([1.0, 3.0, 2.0]) == {"max": 3.0, "mean": 2.0, "median": 2.0, "n": 3}
    assert measure.summary([])["max"] is None
    assert measure.median_ratio([1.0, 2.0, 9.0], [2.0, 4.0, 4.0]) == 0.5
    with pytest.raises(ValueError):
        measure.median_ratio([], [1.0])
    # pairs: a load that doubles both sides of the last pair does not move the median
    assert measure.paired_ratio([1.0, 1.1, 2.0], [1.0, 1.0, 4.0]) == 1.0
    with pytest.raises(ValueError):
        measure.paired_ratio([1.0], [1.0, 2.0])


def test_disk_usage_sums_files_and_names_the_quarantined_ones(tmp_path):
    (tmp_path / "blocks" / "ab").mkdir(parents=True)
    (tmp_path / "blocks" / "ab" / "x.blk").write_bytes(b"1" * 1000)
    (tmp_path / "a.manifest").write_bytes(b"2" * 100)
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "bad").write_bytes(b"3" * 10)
    os.symlink(tmp_path / "a.manifest", tmp_path / "link")   # a link is not a second copy
    u = measure.disk_usage(tmp_path)
    assert (u.bytes, u.files, u.quarantine_bytes, u.quarantine_files) == (1110, 3, 10, 1)
    assert u.allocated >= 0 and u.as_dict()["bytes"] == 1110


def test_the_ideal_is_one_copy_of_the_shared_prefix_and_each_agents_own_tokens():
    ids = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 8, 8], [1, 2, 3, 5]]
    assert shared_prefix(ids) == 3 and shared_prefix([]) == 0
    assert shared_prefix([[1, 2], [1, 2, 3]]) == 2
    assert measure.ideal_shared_bytes(10.0, 2200, [48, 50]) == 10.0 * 2298


def test_the_layout_flag_is_passed_only_when_named():
    assert layout_args("blocks", "--cache-layout", ["--sync-saves"]) == ["--sync-saves", "--cache-layout", "blocks"]
    assert layout_args("blocks", "", ["--sync-saves"]) == ["--sync-saves"]


def test_evicting_a_directory_from_the_page_cache_touches_only_its_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 8192)
    (tmp_path / "g").write_bytes(b"y")
    assert evict_page_cache(tmp_path) == (2 if hasattr(os, "posix_fadvise") else 0)
    assert (tmp_path / "d" / "f").read_bytes() == b"x" * 8192


def _turn(layout, text="ok", prompt=100, cached=90, completion=16, ttft=0.5, total=1.0, **extra):
    return {"layout": layout, "text": text, "prompt_tokens": prompt, "cached_tokens": cached,
            "completion_tokens": completion, "ttft_s": ttft, "total_s": total, **extra}


def _out() -> dict:
    """Phase outputs as the kind's phases write them, with made-up numbers."""
    bpt = 100.0
    wa = [_turn(lay, turn=0, measured=False) for lay in ("blocks", "file")]
    for n, (written_b, written_f) in enumerate([(1300, 30000), (2600, 31000)], start=1):
        for lay, w in (("blocks", written_b), ("file", written_f)):
            wa.append(_turn(lay, turn=n, measured=True, prompt=200 + n, cached=190 + n, completion=3,
                            prev_prompt_tokens=100 + n, written_bytes=w, added_tokens=13, added_bytes=13 * bpt,
                            amplification=w / (13 * bpt)))
    shared = {"shared_tokens": 600, "rows": [], "disk": {
        lay: {"bytes": b, "ideal_bytes": 70000.0, "over_ideal": b / 70000.0, "quarantine_bytes": 0}
        for lay, b in (("blocks", 74000), ("file", 280000))}}
    restart = {"sizes": {"short": 512, "long": 1024}, "rows": [
        _turn(lay, size=size, rep=rep, ttft=t, prev_prompt_tokens=80)
        for rep in range(2) for lay, f in (("blocks", 1.0), ("file", 2.0)) for size, t in
        (("short", 0.1 * f), ("long", 0.3 * f + rep * 0.01))]}
    beside = {"rows": [{"layout": lay, "rep": rep, "quiet": _turn(lay, prompt=1584, cached=1583, total=1.0),
                        "saver": _turn(lay), "beside": _turn(lay, prompt=1584, cached=1583, total=q),
                        "written_during_beside": w}
                       for rep in range(3) for lay, q, w in (("blocks", 1.05, 0), ("file", 1.4, 7_000_000))]}
    return {"write_amp": {"bytes_per_token": bpt, "rows": wa}, "shared_prompt": shared, "restart": restart,
            "beside_save": beside, "failed": []}


def test_the_checks_of_each_phase():
    out, layouts = _out(), ["blocks", "file"]
    w = write_amp_checks(out["write_amp"], layouts)
    assert w["write_turns_cached"] and w["write_amp_blocks_max"] == 2.0 and w["write_amp_blocks_mean"] == 1.5
    assert w["write_amp_file_total"] == pytest.approx(61000 / 2600)
    r = restart_checks(out["restart"], layouts)
    assert r["restart_blocks_over_file_short"] == pytest.approx(0.5) and r["restart_resumes_from_disk"]
    assert r["restart_blocks_over_file"] == max(r["restart_blocks_over_file_short"], r["restart_blocks_over_file_long"])
    b = beside_checks(out["beside_save"], layouts)
    assert b["beside_over_quiet_blocks"] == pytest.approx(1.05) and b["beside_over_quiet_file"] == pytest.approx(1.4)
    assert (b["beside_overlapped_blocks"], b["beside_overlapped_file"]) == (0.0, 1.0)
    assert b["foreground_cached_share"] == pytest.approx(1583 / 1584)


def test_a_turn_that_did_not_resume_fails_its_check():
    out = _out()
    out["restart"]["rows"][0]["cached_tokens"] = 0
    assert not restart_checks(out["restart"], ["blocks", "file"])["restart_resumes_from_disk"]


def test_replies_that_differ_between_the_layouts_are_counted_and_shown():
    out = _out()
    assert replies_differing(out, ["blocks", "file"])[0] == 0
    out["restart"]["rows"][0]["text"] = "something else"
    out["beside_save"]["rows"][1]["beside"]["text"] = "other"
    n, shown = replies_differing(out, ["blocks", "file"])
    assert n == 2 and {tuple(d["turn"][:1]) for d in shown} == {("restart",), ("beside_save",)}


def test_every_criterion_of_the_experiment_names_a_check_the_kind_writes():
    config = load("exp_017_block_store", quick=True)
    doc = {"checks": all_checks(_out(), config.params["layouts"])}
    for c in config.criteria:
        resolve(doc, c.value)   # KeyError: a criterion no run could ever judge


def test_the_layouts_must_be_two_distinct_names():
    with pytest.raises(ConfigError, match="layouts"):
        load("exp_017_block_store", overrides=['params.layouts=["blocks"]'])
    with pytest.raises(ConfigError, match="phases"):
        load("exp_017_block_store", overrides=['params.phases=["nope"]'])


def test_a_failed_phase_is_counted_and_the_others_still_give_their_checks():
    out = _out()
    del out["restart"]
    out["failed"] = [{"phase": "restart", "error": "server exited 2 at start: unrecognized arguments"}]
    c = all_checks(out, ["blocks", "file"])
    assert c["phases_failed"] == 1 and "restart_blocks_over_file" not in c and "write_amp_blocks_max" in c
