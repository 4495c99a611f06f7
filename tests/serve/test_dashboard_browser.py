"""The dashboard page in a real headless Chromium (Debian's), against a live tiny-model server.

The page is plain HTML and JS polling ``/v1/cache/stats``; the browser runs
its script, and the DOM it leaves must show the server's numbers. The
screenshot is written to ``$SEMANTIC_DASHBOARD_SHOT`` when that is set
(``make dashboard-screenshot`` refreshes the one beside the README).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import httpx
import openai
import pytest

from harness.models.tiny import write_tiny_llama
from tests.fs_helpers import fill, tmpfs
from tests.serve_helpers import Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
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
