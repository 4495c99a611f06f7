"""A real ``semantic serve`` on 127.0.0.1 in a subprocess, for the SDK-driven tests.

Each server is its own process (``python -m semantic.serve``), started on a
free loopback port and waited for through ``GET /health``; stopping it sends
SIGTERM (or SIGKILL) and waits, so a test can restart one on the same cache
directory and see what survived. ``model=None``: ``args`` name the models
(``--model ID=DIR`` and the rest), for a server of several.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from harness.servers.processes import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    model: Path | None  # None: ``args`` carry the models
    cache_dir: Path
    args: list[str] = field(default_factory=list)
    model_id: str = "tiny"
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    log_dir: Path | None = None  # default: beside the cache directory

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "Server":
        self.port = free_port()
        self.log_path = (self.log_dir or self.cache_dir.parent) / f"server-{self.port}.log"
        one = ["--model", str(self.model), "--model-id", self.model_id] if self.model is not None else []
        cmd = [sys.executable, "-m", "semantic.serve", *one, "--port", str(self.port),
               "--cache-dir", str(self.cache_dir), *self.args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "wb") as log:  # the child holds its own copy of the descriptor
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"server did not answer /health within {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise RuntimeError(f"server ignored {signal.Signals(sig).name} for {timeout} s:\n{self.log()}")

    def stop_cleanly(self) -> bool:
        """SIGTERM, then whether the server shut down gracefully (uvicorn re-raises
        the signal after its shutdown completes, so the exit code is 0 or -SIGTERM)."""
        code = self.stop(signal.SIGTERM)
        return code in (0, -signal.SIGTERM) and "Application shutdown complete" in self.log()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""

    def stats(self, key: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + "/v1/cache/stats", headers=headers, timeout=10).json()

    def wait_saved(self, key: str | None = None, timeout: float = 60.0) -> None:
        """Until no save is pending (every finished turn's cache is on disk)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats(key)
            if s["saves"]["pending"] == 0 and s["requests"]["in_flight"] == 0 and s["requests"]["queued"] == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"saves still pending after {timeout} s: {s['saves']}")
