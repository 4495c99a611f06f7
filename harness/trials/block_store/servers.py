"""One ``semantic serve`` per store layout, on 127.0.0.1, each with its own cache directory.

The layout is chosen by a server flag (``--cache-layout blocks`` / ``--cache-layout file``); with an
empty flag name no flag is passed and every "layout" is the server's default, which checks the harness
itself (both sides then measure the same store). Servers are :class:`~harness.servers.ours.OurServer`:
they import ``semantic`` from this checkout, keep their port across restarts, and answer
``/v1/cache/stats``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from harness.servers.client import client
from harness.servers.ours import OurServer
from harness.trials.block_store.measure import kv_bytes_per_token, read_proc_io


def layout_args(layout: str, flag: str, base: list[str]) -> list[str]:
    """The server's arguments: ``base``, then ``flag layout`` unless ``flag`` is empty."""
    return [*base, *([flag, layout] if flag else [])]


class LayoutServer:
    """A server of one layout: its process, cache directory, I/O counters and a client."""

    def __init__(self, layout: str, model_dir: Path, model_id: str, work: Path, args: list[str], timeout_s: float):
        self.layout, self.cache_dir = layout, work / f"cache-{layout}"
        self.server = OurServer(model_dir, model_id, self.cache_dir, work / f"server-{layout}.log", args)
        self.model_id, self.timeout_s = model_id, timeout_s
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = client(self.server.url, self.timeout_s)
        return self._client

    def start(self) -> float:
        return self.server.start()

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return self.server.stop(sig)

    def kill(self) -> None:
        self.server.kill_now()

    def io(self) -> dict[str, int]:
        pid = self.server.pid
        if pid is None:
            raise RuntimeError(f"the {self.layout} server is not running:\n{self.server.log_tail()}")
        return read_proc_io(pid)

    def stats(self) -> dict:
        st = self.server.stats(timeout_s=30)
        if st is None:
            raise RuntimeError(f"the {self.layout} server's /v1/cache/stats did not answer:\n{self.server.log_tail()}")
        return st

    def bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.stats())

    def restart(self, evict: bool) -> float:
        """SIGTERM (its pending saves are written first), wait for the exit, drop its cache files from the
        page cache (``evict``: the next load reads the disk, as after a reboot), start again on the same
        directory; returns the seconds to ``/health``."""
        self.stop(signal.SIGTERM)
        if evict:
            evict_page_cache(self.cache_dir)
        return self.start()


def start_servers(layouts: list[str], flag: str, base: list[str], model_dir: Path, model_id: str, work: Path,
                  timeout_s: float) -> list[LayoutServer]:
    """Start one server per layout (one after the other, so their model loads do not contend)."""
    work.mkdir(parents=True, exist_ok=True)
    servers = []
    try:
        for layout in layouts:
            s = LayoutServer(layout, model_dir, model_id, work, layout_args(layout, flag, base), timeout_s)
            servers.append(s)
            s.start()
    except BaseException:
        stop_all(servers, signal.SIGKILL)
        raise
    return servers


def stop_all(servers: list[LayoutServer], sig: int = signal.SIGTERM) -> None:
    for s in servers:
        try:
            s.stop(sig)
        finally:
            s.kill()


def evict_page_cache(root: Path) -> int:
    """Ask the kernel to drop every file under ``root`` from the page cache (``POSIX_FADV_DONTNEED``: this
    directory's pages only, nothing else on the machine); returns the files advised."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    n = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)  # dirty pages are not dropped: written first (a SIGTERM's save is already)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return n


def wait_idle(servers: list[LayoutServer], settle_s: float, max_s: float) -> list[dict[str, int]]:
    """Poll until every server's ``write_bytes`` stayed the same for ``settle_s`` and none has a save pending;
    returns each server's I/O counters as read once they stood still (before the stats request, whose
    access-log line is no part of a save). Raises past ``max_s``: a measurement beside an unfinished save
    is no measurement of a quiet server."""
    t0 = time.monotonic()
    while True:
        ios = _still(servers, settle_s, t0 + max_s)
        pending = [s.stats()["saves"]["pending"] for s in servers]
        if not any(pending):
            return ios
        if time.monotonic() - t0 > max_s:
            raise RuntimeError(f"servers still saving after {max_s:.0f} s: pending {pending}")
        time.sleep(0.05)


def _still(servers: list[LayoutServer], settle_s: float, deadline: float) -> list[dict[str, int]]:
    """The servers' counters once no ``write_bytes`` changed for ``settle_s`` (polled every 50 ms)."""
    ios = [s.io() for s in servers]
    still_since = time.monotonic()
    while time.monotonic() - still_since < settle_s:
        time.sleep(0.05)
        now = [s.io() for s in servers]
        if [i["write_bytes"] for i in now] != [i["write_bytes"] for i in ios]:
            still_since = time.monotonic()
        ios = now
        if time.monotonic() > deadline:
            raise RuntimeError(f"servers' write_bytes still changing at the deadline: {[i['write_bytes'] for i in ios]}")
    return ios


def server_accepts(flag: str) -> bool:
    """Whether this checkout's ``semantic serve`` knows ``flag`` (an empty flag is always accepted)."""
    if not flag:
        return True
    from semantic.serve.cli import build_parser

    return flag in build_parser()._option_string_actions
