"""The dashboard page in a real headless Chromium (Debian's), against a live tiny-model server.

The page is plain HTML and JS polling ``/v1/cache/stats``; the browser runs
its script, and the DOM it leaves must show the server's numbers. The
screenshots are written to ``$SEMANTIC_DASHBOARD_SHOT`` (one model) and
``$SEMANTIC_DASHBOARD_MODELS_SHOT`` (several) when those are set
(``make dashboard-screenshot`` refreshes them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from harness.models.tiny import write_tiny_llama
from tests.browser_helpers import CHROMIUM, Browser
from tests.fs_helpers import fill, tmpfs
from tests.serve_helpers import Server

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `make system-browser` (apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=5000"]


def _browser(*args: str) -> str:
    out = subprocess.run([CHROMIUM, *FLAGS, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_dashboard_shows_hit_rate_bytes_agents_and_recent_ttfts(tmp_path):
    s = Server(write_tiny_llama(tmp_path / "model"), tmp_path / "agents", ["--pool-mb", "64"]).start()
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        system = {"role": "system", "content": "You are one of several agents sharing this prompt. " * 12}
        for i in range(4):
            client.chat.completions.create(model="tiny", max_tokens=8, prompt_cache_key=f"agent-{i % 2}",
                                           messages=[system, {"role": "user", "content": f"turn {i}"}])
        stats = s.stats()
        dom = _browser("--dump-dom", s.url + "/dashboard")
        shot = tmp_path / "dashboard.png"
        _browser("--window-size=1280,900", f"--screenshot={shot}", s.url + "/dashboard")
    finally:
        assert s.stop_cleanly(), s.log()

    def text_of(element_id: str) -> str:
        m = re.search(rf'id="{element_id}"[^>]*>(.*?)</', dom, re.S)
        assert m, f"no #{element_id} in the page"
        return m.group(1)

    hit = float(text_of("hit-rate").split()[0])
    assert hit == pytest.approx(100 * stats["tokens"]["hit_rate"], abs=0.1) and hit > 0
    assert "agent-0" in dom and "agent-1" in dom  # the agents table
    assert len(re.findall(r"<tr><td>", dom.split('id="recent"')[1].split("</tbody>")[0])) == 4  # recent TTFTs
    assert "MiB" in text_of("ram-bytes") and "MiB" in text_of("disk-bytes")
    assert re.search(r'<div id="disk-alert"[^>]*hidden', dom)  # saves work: no alert
    assert re.search(r'<section id="fleet"[^>]*hidden', dom)  # one model: no models table, the page as before
    assert re.search(r'<div id="model-note"[^>]*hidden', dom) and not re.search(r'<div id="panels"[^>]*hidden', dom)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    if os.environ.get("SEMANTIC_DASHBOARD_SHOT"):
        shutil.copyfile(shot, os.environ["SEMANTIC_DASHBOARD_SHOT"])


def test_the_dashboard_says_so_when_the_disk_is_full(tmp_path):
    with tmpfs(4) as where:
        s = Server(write_tiny_llama(tmp_path / "model"), where / "agents", ["--pool-mb", "64"],
                   log_dir=tmp_path).start()
        try:
            httpx.get(s.url + "/health", timeout=10)  # the cache directory exists: now nothing fits beside it
            filler = fill(where)
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
            client.chat.completions.create(model="tiny", max_tokens=4, prompt_cache_key="agent-0",
                                           messages=[{"role": "user", "content": "hello"}])
            s.wait_saved()
            full = _browser("--dump-dom", s.url + "/dashboard")
            filler.unlink()
        finally:
            assert s.stop_cleanly(), s.log()
    alert = re.search(r'<div id="disk-alert"([^>]*)>(.*?)</div>', full, re.S)
    assert alert and "hidden" not in alert.group(1), full[:2000]
    assert alert.group(2).startswith("The disk is full: caches stay in RAM")


# what the page shows, read in the browser: every model's row, the selection, the panels or the note
PAGE = """(() => {
  const $ = (id) => document.getElementById(id);
  const rows = {};
  for (const tr of document.querySelectorAll("#models tr[data-model]")) {
    rows[tr.dataset.model] = { state: tr.dataset.state, selected: tr.getAttribute("aria-selected") === "true",
                               cells: [...tr.cells].map((td) => td.textContent) };
  }
  return { rows, title: $("model").textContent, picked: $("model-select").value, fleet: $("fleet").hidden ? null :
           $("fleet-text").textContent, segments: $("fleet-bar").children.length, panels: !$("panels").hidden,
           note: $("model-note").hidden ? null : $("model-note").textContent, hit: $("hit-rate").textContent,
           agents: [...document.querySelectorAll("#agents tr")].map((tr) => tr.cells[0].textContent),
           errors: [...document.querySelectorAll("#models tr[data-error-of]")].map((tr) => tr.textContent),
           remembered: localStorage.getItem("semantic.model") };
})()"""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def test_the_dashboard_shows_every_model_and_switches_between_them(tmp_path):
    """Three models: ``main`` pinned and loaded, ``small`` not loaded until a request names it, ``broken`` failed.
    Picking a model (the select, then a row) shows its panels; the pick survives a reload."""
    main, small = write_tiny_llama(tmp_path / "main"), write_tiny_llama(tmp_path / "small", seed=1, layers=2)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no weights: its load fails
    s = Server(None, tmp_path / "agents", ["--model", f"main={main}", "--model", f"small={small}",
                                           "--model", f"broken={broken}", "--pin", "main", "--alias",
                                           "claude-*haiku*=small", "--models-mb", "1024", "--idle-ttl", "600",
                                           "--pool-mb", "64"]).start()
    shot = None
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        system = {"role": "system", "content": "You are one of several agents sharing this prompt. " * 12}
        for i in range(3):
            client.chat.completions.create(model="main", max_tokens=8, prompt_cache_key=f"agent-{i % 2}",
                                           messages=[system, {"role": "user", "content": f"turn {i}"}])
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="broken", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert failed.value.status_code == 503
        s.wait_saved()
        stats = s.stats()
        with Browser(s.url + "/dashboard", height=1100) as b:
            b.wait("document.querySelectorAll('#models tr[data-model]').length === 3"
                   " && !document.getElementById('panels').hidden")
            page = b.js(PAGE)
            assert {m: (r["state"], r["selected"]) for m, r in page["rows"].items()} == {
                "main": ("loaded", True), "small": ("unloaded", False), "broken": ("failed", False)}
            row = {m["id"]: m for m in stats["models"]}
            assert page["rows"]["small"]["cells"][2] == "claude-*haiku*"  # aliases
            assert page["rows"]["main"]["cells"][3].startswith(_mib(row["main"]["memory_bytes"]))  # memory vs budget
            assert page["rows"]["main"]["cells"][4:6] == ["yes", "never"]  # pinned, idle TTL
            assert page["rows"]["small"]["cells"][4:6] == ["no", "600 s"]
            assert page["rows"]["main"]["cells"][6] == "1 / 0" and page["rows"]["small"]["cells"][3] == "–"
            assert page["errors"] == [f"broken: {row['broken']['error']}"]
            fleet = stats["fleet"]
            assert page["fleet"].startswith(f"memory: {_mib(fleet['resident_bytes'])} of 1.0 GiB")
            assert "failed loads 1" in page["fleet"] and page["segments"] == 1  # only main holds memory
            assert page["title"] == "· main" and page["picked"] == "main" and page["note"] is None
            assert float(page["hit"].split()[0]) == pytest.approx(100 * stats["tokens"]["hit_rate"], abs=0.1)
            assert sorted(page["agents"]) == ["agent-0", "agent-1"]

            # the select: small is not loaded, so a note stands where its panels would be
            b.js("(() => { const p = document.getElementById('model-select'); p.value = 'small';"
                 " p.dispatchEvent(new Event('change')); })()")
            b.wait("!document.getElementById('model-note').hidden")
            page = b.js(PAGE)
            assert page["note"].startswith("small is not loaded: the first request naming it loads it")
            assert not page["panels"] and page["title"] == "· small" and page["remembered"] == "small"
            assert page["rows"]["small"]["selected"] and not page["rows"]["main"]["selected"]

            # a request through small's alias loads it: the page, polling, shows small's own panels
            client.chat.completions.create(model="claude-3-haiku", max_tokens=8, prompt_cache_key="agent-small",
                                           messages=[system, {"role": "user", "content": "hello"}])
            b.wait("document.getElementById('agents').textContent.includes('agent-small')")
            page = b.js(PAGE)
            assert page["rows"]["small"]["state"] == "loaded" and page["panels"] and page["note"] is None
            assert page["agents"] == ["agent-small"] and page["segments"] == 2

            # the pick survives a reload; a click on a row picks again
            b.reload()
            b.wait("document.getElementById('agents').textContent.includes('agent-small')")
            page = b.js(PAGE)
            assert page["picked"] == "small" and page["rows"]["small"]["selected"]
            b.js("document.querySelector('#models tr[data-model=\"main\"]').click()")
            b.wait("document.getElementById('agents').textContent.includes('agent-0')")
            page = b.js(PAGE)
            assert sorted(page["agents"]) == ["agent-0", "agent-1"] and page["remembered"] == "main"

            # a tiny model loads in milliseconds: the loading row is drawn from a real reply with small loading
            loading = b.js("""(async () => {
              const s = await (await fetch("/v1/cache/stats?model=small")).json();
              Object.assign(s.models.find((m) => m.id === "small"), { state: "loading", state_s: 1.5, load_s: 3 });
              Object.assign(s, { state: "loading", fleet: { ...s.fleet, loading: "small", loading_s: 1.5 } });
              show(s);
              const tr = document.querySelector('#models tr[data-model="small"]');
              return { cell: tr.cells[1].textContent, spinner: !!tr.querySelector(".spin"),
                       progress: tr.querySelector(".bar > span").style.width,
                       fleet: document.getElementById("fleet-text").textContent,
                       note: document.getElementById("model-note").textContent };
            })()""")
            assert (loading["cell"], loading["spinner"], loading["progress"]) == ("loading 1.5 s of ~3.0 s", True, "50%")
            assert loading["fleet"].endswith("loading small for 1.5 s")
            assert loading["note"] == "small is loading (1.5 s so far); its panels appear when it is loaded."
            b.wait("!document.getElementById('panels').hidden")  # the next poll: main's panels again
            shot = b.screenshot()
    finally:
        assert s.stop_cleanly(), s.log()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10_000
    if os.environ.get("SEMANTIC_DASHBOARD_MODELS_SHOT"):
        Path(os.environ["SEMANTIC_DASHBOARD_MODELS_SHOT"]).write_bytes(shot)
