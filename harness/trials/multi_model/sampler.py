"""A server's memory every ~100 ms, from outside: its resident set (``VmRSS`` of the process and its
descendants) and what its ``/v1/cache/stats`` says of the fleet (budget, resident bytes, what is loading).

Two threads, so that a stats request the busy server is slow to answer never delays an RSS sample. Each
sample carries the phase it was taken in (:attr:`MemorySampler.phase`, set by the phase as it goes)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from harness.servers.ours import get_json
from harness.servers.processes import _rss, tree_rss

FLEET_KEYS = ("budget_bytes", "resident_bytes", "loading", "loads", "unloads", "load_failures")


class MemorySampler:
    """Samples one server until :meth:`stop`: ``rss`` rows ``{t, phase, rss_bytes}`` and, with a ``url``,
    ``fleet`` rows ``{t, phase, <FLEET_KEYS>, states}`` (``fleet`` None where the server has none)."""

    def __init__(self, pid_of: Callable[[], int | None], url: str | None, interval_s: float = 0.1,
                 phase: str = ""):
        self.pid_of, self.url, self.interval_s, self.phase = pid_of, url, interval_s, phase
        self.rss: list[dict] = []
        self.fleet: list[dict] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._loop, args=(self._rss_once,), daemon=True)]
        if url:
            self._threads.append(threading.Thread(target=self._loop, args=(self._fleet_once,), daemon=True))

    def start(self) -> MemorySampler:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self, once: Callable[[], None]) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def _rss_once(self) -> None:
        pid = self.pid_of()
        if pid:
            self.rss.append({"t": round(time.monotonic() - self._t0, 3), "phase": self.phase,
                             "rss_bytes": tree_rss(pid), "file_bytes": _rss(pid, "RssFile")})

    def _fleet_once(self) -> None:
        st = get_json(self.url, "/v1/cache/stats", timeout_s=1.0)
        if st is None:
            return
        fleet = st.get("fleet")
        row = {"t": round(time.monotonic() - self._t0, 3), "phase": self.phase}
        if fleet is None:
            self.fleet.append({**row, "fleet": None})
            return
        states = {m.get("id"): m.get("state") for m in st.get("models") or []}
        self.fleet.append({**row, **{k: fleet.get(k) for k in FLEET_KEYS}, "states": states})

    def wait_samples(self, n: int, max_s: float = 30.0) -> None:
        """Wait (bounded) until at least ``n`` RSS samples of the current phase are in."""
        deadline = time.monotonic() + max_s
        while sum(r["phase"] == self.phase for r in self.rss) < n and time.monotonic() < deadline:
            time.sleep(self.interval_s / 2)
