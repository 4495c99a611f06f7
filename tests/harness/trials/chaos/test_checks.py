"""EXP-015's bookkeeping without a server: the durability check, the fault plan, file damage, RSS, sizes."""

from __future__ import annotations

import json

import numpy as np

from harness.trials.chaos import fs
from harness.trials.chaos.checks import rss_checks
from harness.trials.chaos.injector import FaultPlan
from harness.trials.chaos.ledger import Ledger, Reply
from harness.trials.chaos.trial import sizes


def reply(prompt: int, cached: int | None, save: str | None = "saved") -> Reply:
    return Reply("hi", [], prompt, cached, save, None, 0.1)


def test_a_saved_turn_must_be_found_cached_in_the_next_life():
    led = Ledger()
    assert led.answered("a", 1, reply(100, 0), 1.0) is None
    assert led.answered("a", 1, reply(150, 140, "pending"), 2.0) is None   # same life: nothing to check
    lost = led.answered("a", 2, reply(170, 99), 3.0)                        # 100 was the durable turn
    assert lost["verdict"] == "lost" and lost["durable_prompt_tokens"] == 100
    kept = led.answered("a", 3, reply(200, 170), 4.0)
    assert kept["verdict"] == "kept" and kept["durable_prompt_tokens"] == 170
    assert led.summary()["lost_durable_turns"] == 1 and led.summary()["resumptions_checked"] == 2


def test_a_turn_whose_save_failed_leaves_the_earlier_durable_turn_as_the_bar():
    led = Ledger()
    led.answered("a", 1, reply(100, 0), 1.0)
    led.answered("a", 1, reply(300, 100, "failed"), 2.0)     # the disk was full
    assert led.answered("a", 2, reply(320, 120), 3.0)["verdict"] == "kept"


def test_an_agent_without_a_saved_turn_has_nothing_to_lose():
    led = Ledger()
    led.answered("a", 1, reply(100, 0, "failed"), 1.0)
    assert led.answered("a", 2, reply(120, 0), 2.0) is None


def test_a_corrupted_file_excuses_the_miss_and_a_hit_is_a_served_corruption():
    led = Ledger()
    for agent in ("a", "b"):
        led.answered(agent, 1, reply(100, 0), 1.0)
        led.corrupted(agent)
    assert led.answered("a", 2, reply(120, 30, "failed"), 2.0)["verdict"] == "excused_corrupt"
    assert led.answered("b", 2, reply(120, 100), 2.0)["verdict"] == "corrupt_served"
    assert led.answered("a", 3, reply(140, 40), 3.0) is None    # its file is gone: no bar until a save
    led.answered("a", 3, reply(160, 140), 3.5)                   # saved again: the bar is back
    assert led.answered("a", 4, reply(180, 100), 4.0)["verdict"] == "lost"
    s = led.summary()
    assert (s["resumptions_excused_corrupt"], s["corrupt_served"], s["lost_durable_turns"]) == (1, 1, 1)


def test_the_header_stands_in_for_usage_when_a_reply_has_no_cache_save_field():
    r = Reply("x", [], 10, 0, None, "saved", 0.1)
    assert r.save_state == "saved"


def test_outcomes_are_counted_as_expected_or_failures():
    led = Ledger()
    for outcome in ("ok", "server_down", "interrupted", "refused_429", "http_5xx", "hang"):
        led.request({"outcome": outcome})
    s = led.summary()
    assert (s["turns"], s["failures"], s["http_5xx"], s["hang"], s["requests"]) == (1, 2, 1, 1, 6)


def test_the_fault_plan_is_seeded_complete_and_never_starts_with_a_filesystem_fault():
    plan = FaultPlan(sigkill=4, sigterm=2, corrupt=2, disk_full=1, read_only=1, hangup=1, flood=1)
    for seed in range(20):
        order = plan.draw(np.random.default_rng(seed))
        assert order == plan.draw(np.random.default_rng(seed))
        assert sorted(order) == sorted(["sigkill+corrupt"] * 2 + ["sigkill"] * 2 + ["sigterm"] * 2
                                       + ["disk_full", "read_only", "hangup", "flood"])
        assert order[0] not in ("disk_full", "read_only")
    assert "disk_full" not in plan.draw(np.random.default_rng(0), skip=("disk_full", "read_only"))


def test_corrupt_truncates_or_flips_bytes(tmp_path):
    rng = np.random.default_rng(1)
    modes = set()
    for i in range(8):
        path = tmp_path / f"a{i}.safetensors"
        data = bytes(range(256)) * 64
        path.write_bytes(data)
        done = fs.corrupt(path, rng)
        modes.add(done["mode"])
        after = path.read_bytes()
        assert after != data
        if done["mode"] == "truncate":
            assert len(after) == done["kept"] < len(data)
        else:
            assert len(after) == len(data) and after[:1024] == data[:1024]
    assert modes == {"truncate", "flip"}


def test_temp_and_cache_files_are_told_apart(tmp_path):
    (tmp_path / "a-1.safetensors").write_bytes(b"x")
    (tmp_path / ".a-1.safetensors.77.deadbeef.tmp").write_bytes(b"x")
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "b-2.safetensors.123").write_bytes(b"x")
    assert [p.name for p in fs.cache_files(tmp_path)] == ["a-1.safetensors"]
    assert fs.temp_files(tmp_path) == [".a-1.safetensors.77.deadbeef.tmp"]
    assert fs.quarantined_files(tmp_path) == ["b-2.safetensors.123"]


def test_rss_compares_the_last_life_after_its_baseline_turns_with_its_end():
    rss = [(1, 1, 50, 900), (2, 2, 10, 500), (3, 2, 100, 600), (4, 2, 300, 700)]
    c = rss_checks(rss, last_life=2, baseline_turns=100, end_bytes=None)
    assert (c["rss_baseline_bytes"], c["rss_end_bytes"], c["rss_max_bytes"]) == (600, 700, 900)
    assert abs(c["rss_end_over_baseline"] - 700 / 600) < 1e-9
    assert rss_checks(rss, 2, 1000, None)["rss_end_over_baseline"] is None


def test_the_ram_budget_is_a_quarter_of_the_agents_kv_working_set(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 30, "num_key_value_heads": 3, "num_attention_heads": 9,
        "head_dim": 64, "hidden_size": 576}))
    p = {"tools_prob": 0.0, "max_tokens": 10, "tool_max_tokens": 40, "system_tokens": 300,
         "turns_per_session": [3, 5], "agents": 16, "ram_share": 0.25, "disk_mb": 0}
    s = sizes(p, tmp_path, "f32")
    assert s["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4          # keys and values, float32
    assert s["history_tokens"] == 300 + 20 + 5 * 50
    assert s["ram_mb"] == int(0.25 * 16 * 570 * 46080 / 2**20)
    assert s["tmpfs_mb"] > s["disk_mb"] >= 2 * 16 * 570 * 46080 // 2**20


def test_an_error_event_in_a_begun_stream_is_a_refusal_during_a_shutdown_and_a_failure_otherwise():
    import threading
    from types import SimpleNamespace

    import anthropic
    import httpx

    from harness.trials.chaos.agents import classify

    request = httpx.Request("POST", "http://127.0.0.1/v1/messages")
    event = anthropic.APIStatusError("the server is shutting down", response=httpx.Response(200, request=request),
                                     body=None)
    up = threading.Event()
    up.set()
    stopping = SimpleNamespace(life=3, up=up, stopping="SIGTERM")
    quiet = SimpleNamespace(life=3, up=up, stopping=None)
    assert classify(event, stopping, 3, True).outcome == "refused_shutting_down"
    assert classify(event, quiet, 3, True).outcome == "stream_error"


def test_a_corrupted_file_of_an_agent_with_no_saved_turn_yet_is_forgotten_at_the_next_life():
    # its turn before the damage reported no usage, so nothing was durable; the next life quarantines the
    # file, the agent saves a new one, and the life after that must judge the new file as any other
    led = Ledger()
    led.answered("a", 1, reply(None, None, None), 1.0)
    led.corrupted("a")
    assert led.answered("a", 2, reply(515, 422), 2.0) is None
    assert led.answered("a", 3, reply(582, 555), 3.0)["verdict"] == "kept"
    assert led.summary()["corrupt_served"] == 0


# ------------------------------------------------------------------ the block layout's files


def _manifest(cache_dir, name: str, agent: str, tokens: list[int], keys: list[str]) -> None:
    """A manifest as the store writes it (outer JSON around the document's text; the checksum unchecked here)."""
    doc = {"format_version": 3, "agent_id": agent, "token_ids": tokens,
           "extents": {"global": [[k, 4 * i, 4 * i + 4] for i, k in enumerate(keys)]}}
    (cache_dir / name).write_text(json.dumps({"semantic_kv_manifest": json.dumps(doc), "semantic_kv_xxh3_128": "0"}))


def _block_dir(tmp_path, keys):
    blocks = tmp_path / "blocks-0123456789ab"
    blocks.mkdir()
    for k in keys:
        (blocks / f"{k}.kvb").write_bytes(b"\x10" + bytes(7) + b" " * 16 + bytes(20000))
    return blocks


def test_temp_and_cache_files_of_the_block_layout_are_told_apart(tmp_path):
    blocks = _block_dir(tmp_path, ["00000000000000aa"])
    _manifest(tmp_path, "public-a-1.kvm", "public/a", [1, 2, 3, 4], ["00000000000000aa"])
    (blocks / ".00000000000000bb.kvb.77.deadbeef.tmp").write_bytes(b"x")
    (tmp_path / ".public-a-1.kvm.78.cafebabe.tmp").write_bytes(b"x")
    assert [p.name for p in fs.cache_files(tmp_path)] == ["public-a-1.kvm", "00000000000000aa.kvb"]
    assert fs.temp_files(tmp_path) == [".public-a-1.kvm.78.cafebabe.tmp",
                                       "blocks-0123456789ab/.00000000000000bb.kvb.77.deadbeef.tmp"]


def test_a_flip_says_whether_it_hit_a_block_files_header_or_only_its_tensors(tmp_path):
    rng = np.random.default_rng(3)
    regions = set()
    for i in range(12):
        path = tmp_path / f"{i:016x}.kvb"
        header = (1030, 40000)[i % 2]
        path.write_bytes(header.to_bytes(8, "little") + b" " * header + bytes(20000))
        done = fs.corrupt(path, rng)
        if done["mode"] == "flip":
            regions.add(done["region"])
            assert done["region"] == ("header" if done["offsets"][0] < 8 + header else "data")
    assert regions == {"header", "data"}


def test_damage_tells_shared_block_files_from_one_agents_and_takes_each_kind_in_turn(tmp_path):
    from harness import storefiles
    from harness.trials.chaos import damage

    _block_dir(tmp_path, ["00000000000000aa", "00000000000000bb", "00000000000000cc", "00000000000000dd"])
    _manifest(tmp_path, "public-a-1.kvm", "public/a", [1] * 8, ["00000000000000aa", "00000000000000bb"])
    _manifest(tmp_path, "public-b-1.kvm", "public/b", [1] * 8, ["00000000000000aa", "00000000000000cc"])
    m = storefiles.read_manifest(tmp_path / "public-a-1.kvm")
    assert (m.agent_id, m.token_ids, m.blocks) == ("public/a", (1,) * 8, {"00000000000000aa.kvb", "00000000000000bb.kvb"})
    found = damage.candidates(tmp_path, ["a", "b"])
    assert [(d.path.name, d.agents) for d in found["shared_block"]] == [("00000000000000aa.kvb", {"a", "b"})]
    assert sorted((d.path.name, tuple(d.agents)) for d in found["block"]) == [
        ("00000000000000bb.kvb", ("a",)), ("00000000000000cc.kvb", ("b",))]   # dd: no manifest names it
    assert sorted(tuple(d.agents) for d in found["manifest"]) == [("a",), ("b",)]
    rng = np.random.default_rng(0)
    picked = []
    for _ in range(4):
        picked.append(damage.choose(tmp_path, ["a", "b"], {"b"}, [d.pick for d in picked], rng))
    assert [d.pick for d in picked] == ["shared_block", "manifest", "block", "shared_block"]
    assert [(d.kind, d.shared) for d in picked[:3]] == [("block", True), ("manifest", False), ("block", False)]
    assert picked[1].agents == {"b"} and picked[2].path.name == "00000000000000cc.kvb"   # the live agent's


def test_with_no_shared_block_file_yet_the_next_damage_takes_the_kind_still_missing(tmp_path):
    from harness.trials.chaos import damage

    _block_dir(tmp_path, ["00000000000000aa"])
    _manifest(tmp_path, "public-a-1.kvm", "public/a", [1] * 4, ["00000000000000aa"])
    rng = np.random.default_rng(0)
    first = damage.choose(tmp_path, ["a"], {"a"}, [], rng)
    assert first.pick == "manifest"                    # no block file two manifests name
    assert damage.choose(tmp_path, ["a"], {"a"}, [first.pick], rng).pick == "block"
    assert damage.choose(tmp_path / "nothing", ["a"], set(), [], rng) is None


def test_a_damaged_block_file_excuses_its_agents_until_it_is_written_again(tmp_path):
    from harness.trials.chaos import damage

    blocks = _block_dir(tmp_path, ["00000000000000aa"])
    _manifest(tmp_path, "public-a-1.kvm", "public/a", [1] * 4, ["00000000000000aa"])
    _manifest(tmp_path, "public-b-1.kvm", "public/b", [1] * 4, ["00000000000000aa"])
    d = damage.choose(tmp_path, ["a", "b"], set(), [], np.random.default_rng(0))
    d.detail = fs.corrupt(d.path, np.random.default_rng(0))
    d.seal()
    assert d.state() == "damaged" and d.excuses_now(tmp_path) == {"a", "b"}
    _manifest(tmp_path, "public-c-1.kvm", "public/c", [1] * 4, ["00000000000000aa"])   # a save named it since
    assert d.excuses_now(tmp_path) == {"a", "b", "c"}
    (blocks / "00000000000000aa.kvb").rename(tmp_path / "elsewhere")                      # quarantined
    assert d.state() == "gone" and d.excuses_now(tmp_path) == {"a", "b", "c"}
    (blocks / "00000000000000aa.kvb").write_bytes(b"written again")
    assert d.state() == "rewritten" and d.excuses_now(tmp_path) == set()


def test_a_hit_after_a_shared_block_was_damaged_is_excused_and_after_an_agents_own_file_a_served_corruption():
    led = Ledger()
    for agent in ("a", "b", "c"):
        led.answered(agent, 1, reply(100, 0), 1.0)
    led.corrupted("a", shared=True)
    led.corrupted("b", shared=True)
    led.corrupted("c", shared=True)
    led.corrupted("c")                                        # and its own manifest
    assert led.answered("a", 2, reply(120, 60), 2.0)["verdict"] == "excused_corrupt"
    assert led.answered("b", 2, reply(120, 110), 2.0)["verdict"] == "excused_rebuilt"   # another agent wrote it again
    assert led.answered("c", 2, reply(120, 110), 2.0)["verdict"] == "corrupt_served"
    s = led.summary()
    assert (s["resumptions_excused_corrupt"], s["resumptions_excused_rebuilt"], s["corrupt_served"]) == (2, 1, 1)


def test_a_hit_after_a_damage_is_excused_when_a_turn_sent_since_may_have_saved_a_new_cache():
    led = Ledger()
    for agent in ("a", "b", "c"):
        led.answered(agent, 1, reply(100, 0), 1.0)
    led.request({"kind": "turn", "agent": "a", "t0": led.now() - 5, "outcome": "interrupted"})  # before the damage
    for agent in ("a", "b", "c"):
        led.corrupted(agent)                                     # their manifests
    t = led.now()
    led.request({"kind": "turn", "agent": "b", "t0": t, "outcome": "refused_shutting_down"})   # a SIGTERM's 503
    led.request({"kind": "turn", "agent": "c", "t0": t, "outcome": "server_down"})             # never reached it
    assert led.answered("a", 3, reply(120, 110), 3.0)["verdict"] == "corrupt_served"
    assert led.answered("b", 3, reply(120, 110), 3.0)["verdict"] == "excused_rebuilt"
    assert led.answered("c", 3, reply(120, 110), 3.0)["verdict"] == "corrupt_served"


def test_which_damaged_files_the_server_must_have_set_aside():
    from harness.trials.chaos.checks import must_be_found

    def ev(**kw):
        return {"t": 10.0, "kind": "corrupt", "file": "x", "agents": ["a"], "shared": False, **kw}

    a_back, a_before, b_back = [("a", 12.0)], [("a", 8.0)], [("b", 12.0)]
    assert must_be_found(ev(kind_of_file="manifest", mode="flip"), [])            # every start reads manifests
    assert must_be_found(ev(kind_of_file="block", mode="truncate", shared=True), [])  # and block headers
    assert must_be_found(ev(kind_of_file="block", mode="flip", region="header", shared=True), [])
    assert not must_be_found(ev(kind_of_file="block", mode="flip", region="data", shared=True), a_back)  # the pool
    assert not must_be_found(ev(kind_of_file="block", mode="flip", region="data"), [])        # never read yet
    assert not must_be_found(ev(kind_of_file="block", mode="flip", region="data"), a_before)  # back before it
    assert must_be_found(ev(kind_of_file="block", mode="flip", region="data"), a_back)        # its one agent loaded it
    assert must_be_found(ev(mode="flip"), a_back) and not must_be_found(ev(mode="flip"), b_back)  # single-file layout


def test_a_corrupting_crash_waits_for_a_file_of_the_kind_it_wants(tmp_path):
    from types import SimpleNamespace

    from harness.trials.chaos.injector import Injector

    inj = Injector(SimpleNamespace(), SimpleNamespace(agent_ids=["a", "b"], live={}), Ledger(), FaultPlan(), None,
                   tmp_path, 0, 4)
    assert inj._await_damageable(timeout_s=0.3) >= 0.3          # nothing saved yet: it waits, then goes on
    _block_dir(tmp_path, ["00000000000000aa"])
    _manifest(tmp_path, "public-a-1.kvm", "public/a", [1] * 4, ["00000000000000aa"])
    assert inj._await_damageable(timeout_s=0.3) >= 0.3          # a shared block file is wanted first
    _manifest(tmp_path, "public-b-1.kvm", "public/b", [1] * 4, ["00000000000000aa"])
    assert inj._await_damageable(timeout_s=5) < 1
