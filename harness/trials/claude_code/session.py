"""Claude Code from npm: installed once into a git-ignored folder, pinned and stamped; one print-mode session.

Like the peers' venvs (``harness.servers.venvs``), the install lives under
``.peers/claude-code-<version>/`` with a stamp naming what was installed; a
second call reads the stamp. Its Linux binary comes from npm too (the
``@anthropic-ai/claude-code-linux-x64`` optional dependency), so no network
is needed once installed, and a session talks to nothing but the base URL
it is given (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``). Each session
has its own ``HOME``, so the user's own settings and history never mix in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from harness.servers.targets import ROOT, ServingError, log_tail
from harness.servers.venvs import PEERS, STAMP

PACKAGE = "@anthropic-ai/claude-code"
VERSION = "2.1.330"


class ClientMissing(ServingError):
    """node or npm is not installed here: the experiment records the reason and skips."""


class ClientInstallError(ServingError):
    """npm failed; the message ends with its log's tail."""


@dataclass(frozen=True, slots=True)
class Install:
    binary: Path
    version: str
    install_s: float | None
    installed_now: bool


def ensure(version: str = VERSION, root: Path = ROOT) -> Install:
    """Install ``@anthropic-ai/claude-code@version`` under ``.peers/`` once (the stamp says it is done).

    Raises:
        ClientMissing: no ``node`` or ``npm`` on PATH.
        ClientInstallError: npm failed, or the binary does not report ``version``.
    """
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise ClientMissing(f"{tool} is not installed: Claude Code installs from npm (apt install nodejs npm)")
    where = Path(root) / PEERS / f"claude-code-{version}"
    binary = where / "node_modules" / ".bin" / "claude"
    stamp = where / STAMP
    if stamp.is_file() and binary.exists():
        done = json.loads(stamp.read_text())
        if done.get("version") == version:
            return Install(binary, version, done.get("install_s"), False)
    if where.exists():
        shutil.rmtree(where)
    where.mkdir(parents=True)
    log = where / "install.log"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        rc = subprocess.run(["npm", "install", "--prefix", str(where), "--no-audit", "--no-fund",
                             f"{PACKAGE}@{version}"], stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    if rc != 0 or not binary.exists():
        raise ClientInstallError(f"npm install {PACKAGE}@{version} exited {rc}; {log}:\n{log_tail(log)}")
    reported = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=120).stdout.strip()
    if not reported.startswith(version):
        raise ClientInstallError(f"{binary} --version says {reported!r}, not {version}")
    install_s = time.perf_counter() - t0
    stamp.write_text(json.dumps({"package": PACKAGE, "version": version, "reported": reported,
                                 "install_s": round(install_s, 3),
                                 "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
    return Install(binary, version, install_s, True)


@dataclass(frozen=True, slots=True)
class Session:
    """What one ``claude -p`` run printed, and how long it took from the client's side."""

    returncode: int
    wall_s: float
    events: list[dict]   # its stream-json output, one event per line: the whole transcript
    stderr: str

    @property
    def session_id(self) -> str | None:
        """Claude Code's session id (its first event that names one): ``--resume`` it to go on."""
        return next((e["session_id"] for e in self.events if e.get("session_id")), None)

    @property
    def result(self) -> dict | None:
        """The closing ``result`` event (turns, the final text, whether it ended in an error)."""
        return next((e for e in reversed(self.events) if e.get("type") == "result"), None)


# every variable through which Claude Code takes a model name: a session with ``model=None`` sets none of them
MODEL_VARIABLES = ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                   "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_DEFAULT_FABLE_MODEL",
                   "ANTHROPIC_DEFAULT_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")


def session_env(base_url: str, model: str | None, home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What a user sets for a local server: the base URL, a token and the model names (plus ``extra``).

    ``model=None``: no model names at all, so Claude Code sends its own (its defaults and aliases) and the
    server's aliases map them. The environment is built from nothing, so none is inherited either.
    """
    names = {} if model is None else {"ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model}
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": "local", **names,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", **(extra or {})}


def command(install: Install, prompt: str, max_turns: int, resume: bool,
            allowed_tools: str = "Read,Edit,Write,Bash", args: tuple[str, ...] = ()) -> list[str]:
    """``claude -p`` printing its whole transcript as stream-json; ``resume``: ``--continue`` the last session;
    ``args``: more of its flags (``--resume ID``, ``--agents JSON --agent NAME``)."""
    return [str(install.binary), "-p", prompt, "--max-turns", str(max_turns), "--output-format", "stream-json",
            "--verbose", "--allowedTools", allowed_tools, *(["--continue"] if resume else []), *args]


def start(install: Install, *, base_url: str, model: str | None, repo: Path, home: Path, prompt: str,
          max_turns: int, resume: bool = False, extra_env: dict[str, str] | None = None,
          args: tuple[str, ...] = ()) -> subprocess.Popen:
    """A session started and left running (the caller waits, or kills it)."""
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command(install, prompt, max_turns, resume, args=args), cwd=repo,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=session_env(base_url, model, home, extra_env), start_new_session=True)


def run_session(install: Install, *, base_url: str, model: str | None, repo: Path, home: Path, prompt: str,
                max_turns: int, resume: bool = False, extra_env: dict[str, str] | None = None,
                timeout_s: float = 3600.0, args: tuple[str, ...] = ()) -> Session:
    """One print-mode session in ``repo`` against ``base_url``, to its end (or ``timeout_s``, then killed)."""
    t0 = time.perf_counter()
    proc = start(install, base_url=base_url, model=model, repo=repo, home=home, prompt=prompt, max_turns=max_turns,
                 resume=resume, extra_env=extra_env, args=args)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        rc, err = 124, (err or "") + f"\n(timed out after {timeout_s:.0f} s)"
    return Session(rc, time.perf_counter() - t0, parse_events(out or ""), (err or "")[-4000:])


def stop(proc: subprocess.Popen) -> None:
    """Kill a session and everything it started (its tools' commands too)."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def parse_events(out: str) -> list[dict]:
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            events.append({"type": "text", "text": line})
    return events
