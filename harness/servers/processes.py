"""Servers as processes: start one on 127.0.0.1 and wait for its health probe, read its memory, stop it."""

from __future__ import annotations

import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from harness.servers.blas import BlasMapping, blas_library, blas_of, server_env
from harness.servers.targets import ROOT, Launch, ServerTarget, ServingError, log_tail
from harness.servers.venvs import venv_dir


class ServerStartError(ServingError):
    """A server exited, or did not answer its health probe in time; the message ends with its log tail."""


class NotRunnableHere(ServingError):
    """The target is a record only on this platform (see its ``reason``)."""


PORTS_FROM = 20000  # the ports free_port picks from, up to the ephemeral range (Linux: 32768)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range where it can: a server killed
    and started again on it (a restart, Redis's outage) finds it still free, since no outgoing connection
    is ever given a port there. Random, so that processes picking at once rarely try the same one."""
    low = _ephemeral_low()
    if low > PORTS_FROM + 1024:
        for port in random.SystemRandom().sample(range(PORTS_FROM, low), 64):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # nothing below the range (or no room): any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the range outgoing connections take theirs from (Linux's default where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@dataclass(slots=True)
class Running:
    """A started server: its process, address, log, and the moments it started and answered."""

    target: ServerTarget
    proc: subprocess.Popen
    url: str                  # http://127.0.0.1:PORT (no /v1)
    log_path: Path
    workdir: Path
    model: str                # what requests send as "model"
    blas: str | None          # the OpenBLAS it was given
    start_to_ready_s: float = 0.0
    _log: Any = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self, timeout_s: float = 10.0) -> dict | None:
        """``GET stats_path`` as JSON, or None for a target without one."""
        if not self.target.stats_path:
            return None
        code, body = _get(self.url + self.target.stats_path, timeout_s)
        if code != 200:
            raise ServingError(f"{self.target.name}: GET {self.target.stats_path} answered {code}: {body[:300]!r}")
        return json.loads(body)

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its descendants, in bytes (0 once it has exited)."""
        return tree_rss(self.pid)

    def blas_mapping(self) -> BlasMapping:
        """:func:`blas_of` the server process."""
        return blas_of(self.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send ``sig`` (SIGTERM: graceful; SIGKILL: a crash) and wait; SIGKILL the group after ``timeout_s``.

        Returns:
            The exit status (negative: killed by that signal).
        """
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc)
                self.proc.wait(30)
        if sig == signal.SIGKILL:
            _kill_group(self.proc)   # a crash leaves no workers behind either
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        return log_tail(self.log_path, chars)

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_group(proc: subprocess.Popen) -> None:
    # start() puts each server in its own session, so its group holds only what it spawned.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start(target: ServerTarget, model_dir: Path | str, port: int, workdir: Path | str, *,
          model_id: str | None = None, python: Path | str | None = None, root: Path = ROOT,
          blas: str | None | bool = True, ready_timeout_s: float = 600.0, **settings) -> Running:
    """Start ``target`` on ``127.0.0.1:port`` and wait until its health probe answers 200.

    Args:
        model_dir: the prepared model folder.
        workdir: the server's log (``server.log``) and state; reuse it for a restart.
        model_id: the name ours serves (default: the folder's name).
        python: the target's interpreter (default: this one for ``.venv``
            targets, ``.peers/<venv>/bin/python`` for peers: run :func:`~harness.servers.venvs.ensure_venv` first).
        blas: True for :func:`blas_library`, a path, or None/False for MLX's bundled BLAS.
        settings: the target's own knobs (its ``defaults``), e.g. ``prompt_cache_size=64``.

    Raises:
        NotRunnableHere: a record-only target on this platform.
        ServerStartError: it exited or stayed unready for ``ready_timeout_s`` (with its log tail).
    """
    if not target.runnable_here:
        raise NotRunnableHere(f"{target.name}: {target.reason or 'not runnable on ' + platform.system()}")
    model_dir, workdir = Path(model_dir), Path(workdir)
    if python is None:
        python = sys.executable if target.venv is None else venv_dir(target, root) / "bin" / "python"
    python = Path(python)
    if not python.exists():
        raise ServerStartError(f"{target.name}: no interpreter at {python}; run ensure_venv first")
    blas_path = blas_library() if blas is True else (blas or None)
    launch = Launch(python=python, model_dir=model_dir, model_id=model_id or model_dir.name, port=port,
                    workdir=workdir, settings=target.settings(**settings))
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "server.log"
    log = open(log_path, "ab")
    cmd = target.command(launch)
    log.write(f"$ {' '.join(cmd)}\n".encode())
    log.flush()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
                            env=server_env(target, launch, blas_path), start_new_session=True)
    running = Running(target, proc, f"http://127.0.0.1:{port}", log_path, workdir,
                      target.request_model(model_dir, launch.model_id), blas_path, _log=log)
    try:
        _wait_ready(running, ready_timeout_s)
    except BaseException:
        running.stop(signal.SIGKILL, timeout_s=10)
        raise
    running.start_to_ready_s = time.perf_counter() - t0
    return running


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, every_s: float) -> str | None:
    """Poll a starting server: ``ready()`` every ``every_s`` until it is true (None), or until the process
    exits ("exited") or ``timeout_s`` has passed ("timeout") first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            return "exited"
        if ready():
            return None
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(every_s)


def _answers(url: str) -> bool:
    """Whether ``GET url`` answers 200 within 2 s (no connection yet: False)."""
    try:
        return _get(url, 2.0)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def _wait_ready(running: Running, timeout_s: float) -> None:
    url = running.url + running.target.health_path
    why = wait_ready(running.proc, lambda: _answers(url), timeout_s, 0.25)
    if why == "exited":
        raise ServerStartError(f"{running.target.name} exited {running.proc.returncode} before it was ready; "
                               f"{running.log_path}:\n{running.log_tail()}")
    if why == "timeout":
        raise ServerStartError(f"{running.target.name} did not answer {url} within {timeout_s:.0f} s; "
                               f"{running.log_path}:\n{running.log_tail()}")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(stat.parent.name))
    return kids


def _descendants(pid: int) -> list[int]:
    try:
        import psutil
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        pass
    except Exception:  # psutil.NoSuchProcess: it has exited
        return []
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every process it started (0 once it has exited)."""
    return sum(_rss(p) for p in [pid, *_descendants(pid)])


def _rss(pid: int, field: str = "VmRSS") -> int:
    """A size ``field`` of ``/proc/PID/status`` in bytes (``RssFile``: the mapped files' part); 0 where unread."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
