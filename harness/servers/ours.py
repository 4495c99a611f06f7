"""``semantic serve`` from this checkout as the trials run it: one process at a time on a fixed port,
killed and started again (EXP-015's victim; EXP-016's, -017's and -019's servers).

Each start is a new *life* (numbered from 1), counted when the process is spawned: it may answer before
``/health`` is polled, and the old one is dead by then, so whatever answers a request sent after the count
is that life. Agents read :attr:`OurServer.life` when they send and when they classify an error: a request
whose life ended under it was interrupted, not failed.
The injector calls :meth:`going_down` before it sends a signal, so that no agent can see the broken
connection before the bookkeeping says why.

The child imports ``semantic`` from this checkout (``PYTHONPATH`` is set to its absolute path), not
from whatever editable install the interpreter has.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from harness.servers.processes import _rss, free_port, wait_ready
from harness.servers.targets import ROOT


def get_json(url: str, path: str, timeout_s: float = 10.0) -> dict | None:
    """``GET url+path`` as JSON; None when it does not answer 200 (a phase records that, it does not stop)."""
    try:
        r = httpx.get(url + path, timeout=timeout_s)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


class OurServer:
    """Start, kill and restart one server; its life counter and up/down state are read by the agents."""

    def __init__(self, model_dir: Path, model_id: str, cache_dir: Path, log_path: Path, args: list[str],
                 ready_timeout_s: float = 300.0):
        self.model_dir, self.model_id, self.cache_dir, self.log_path = model_dir, model_id, cache_dir, log_path
        self.args, self.ready_timeout_s = list(args), ready_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.life = 0
        self.up = threading.Event()
        self.stopping: str | None = None      # "SIGTERM" / "SIGKILL" while a stop is under way
        self.starts: list[float] = []         # seconds from spawn to a 200 from /health, per life

    def command(self) -> list[str]:
        return [sys.executable, "-m", "semantic.serve", "--model", str(self.model_dir), "--model-id", self.model_id,
                "--host", "127.0.0.1", "--port", str(self.port), "--cache-dir", str(self.cache_dir), *self.args]

    def start(self) -> float:
        """Spawn the next life and wait for ``/health``; returns the seconds it took."""
        assert self.proc is None or self.proc.poll() is not None, "a server is already running"
        env = {**os.environ, "PYTHONPATH": str(ROOT.resolve()), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "SEMANTIC_BLAS": "auto"}
        t0 = time.perf_counter()
        self.life += 1
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            log.write(f"\n$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=ROOT, env=env, start_new_session=True)
        why = wait_ready(self.proc, self._healthy, self.ready_timeout_s, 0.1)
        if why == "exited":
            raise RuntimeError(f"server exited {self.proc.returncode} at start:\n{self.log_tail()}")
        if why == "timeout":
            self.kill_now()
            raise RuntimeError(f"server did not answer /health in {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")
        took = time.perf_counter() - t0
        self.starts.append(took)
        self.stopping = None
        self.up.set()
        return took

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def going_down(self, how: str) -> None:
        """Mark the server down before a signal is sent: what breaks from now on is the injector's doing."""
        self.stopping = how
        self.up.clear()

    def stop(self, sig: int, timeout_s: float = 120.0) -> int | None:
        """Send ``sig`` and wait for the exit; returns the exit status (negative: the signal)."""
        self.going_down(signal.Signals(sig).name)
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill_now()
        return self.proc.returncode

    def kill_now(self) -> None:
        """SIGKILL the whole process group (cleanup; nothing is recorded)."""
        self.up.clear()
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait(30)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def rss_bytes(self) -> int:
        """VmRSS of the server process (0 while it is down)."""
        pid = self.pid
        return _rss(pid) if pid else 0

    def stats(self, timeout_s: float = 10.0) -> dict | None:
        """``GET /v1/cache/stats``, or None while it does not answer."""
        return get_json(self.url, "/v1/cache/stats", timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""
