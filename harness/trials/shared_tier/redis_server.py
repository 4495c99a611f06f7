"""One ``redis-server`` process on 127.0.0.1 for the shared tier's experiment and tests.

No persistence (``--save ""``, no AOF): a restart comes back empty, as a Redis that lost its memory
does. Faults a run can inject: :meth:`stop` (SIGKILL) and :meth:`start` again on the same port,
:meth:`pause` / :meth:`resume` (SIGSTOP / SIGCONT: a Redis that answers nothing, so every call
times out), and :meth:`config` (``maxmemory`` and its policy: a full Redis).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.servers.processes import free_port, wait_ready

REDIS = shutil.which("redis-server")


class RedisMissing(RuntimeError):
    """No ``redis-server`` on this machine: ``make system-redis`` installs Debian's."""


@dataclass
class RedisServer:
    """One redis-server that can be killed and started again on its port."""

    workdir: Path
    args: tuple[str, ...] = ()
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        if REDIS is None:
            raise RedisMissing("no redis-server: `make system-redis` (apt-get install redis-server)")
        self.port = self.port or free_port()
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait_ready(self.proc, self._ping, timeout_s, 0.05) is None:
            return self
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGKILL: what it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def config(self, **settings) -> None:
        """``CONFIG SET`` each of ``settings`` (``maxmemory="1mb"``, ``maxmemory_policy="noeviction"``)."""
        import redis

        with redis.Redis(port=self.port, socket_timeout=5) as client:
            for key, value in settings.items():
                client.config_set(key.replace("_", "-"), value)

    def used_memory(self) -> int:
        import redis

        with redis.Redis(port=self.port, socket_timeout=5) as client:
            return int(client.info("memory")["used_memory"])
