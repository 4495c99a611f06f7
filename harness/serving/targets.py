"""The servers EXP-009 compares, as config: how to install, start, probe, read cache hits from, and stop each.

Every target runs as a subprocess on 127.0.0.1 with all its state in one
``workdir`` (log, cache folders, and for vllm-mlx its ``HOME``): a fresh
workdir is a cold server, the same workdir again is a restart.

    venv = ensure_venv(TARGETS["vllm-mlx"], ROOT)           # once; .peers/vllm-mlx/
    with start(TARGETS["vllm-mlx"], model_dir, free_port(), workdir, python=venv.python) as srv:
        before = srv.stats(); ...chat request...; after = srv.stats()
        hits = cached_tokens(srv, usage, before, after)

Fairness: MLX on Linux computes on whatever ``cblas_sgemm`` is first in the
global symbol scope. Ours loads the system OpenBLAS itself (``semantic.blas``,
``SEMANTIC_BLAS=auto``); every peer gets the same file as ``LD_PRELOAD``, and
:func:`blas_of` reads a live process's maps to show it.

Peers that need macOS and Metal (oMLX, LM Studio's mlx-engine) and llama.cpp
are records with ``command=None``: :attr:`ServerTarget.runnable_here` says no
and ``reason`` says why. A macOS run adds their command and platform.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS = ".peers"            # git-ignored: one venv per peer
STAMP = "semantic-install.json"
CACHED_FROM = ("usage", "stats_endpoint", "none")
LINUX_AND_MAC = frozenset({"Linux", "Darwin"})


class ServingError(RuntimeError):
    """Base of this module's errors."""


class InstallError(ServingError):
    """A peer's install recipe failed; the message ends with the tail of its install log."""


class ServerStartError(ServingError):
    """A server exited, or did not answer its health probe in time; the message ends with its log tail."""


class NotRunnableHere(ServingError):
    """The target is a record only on this platform (see its ``reason``)."""


@dataclass(frozen=True, slots=True)
class Launch:
    """Everything a target's command and env builders may use."""

    python: Path             # the interpreter of the target's venv
    model_dir: Path
    model_id: str            # the name ours serves the model under
    port: int
    workdir: Path            # the server's log and all its state
    settings: Mapping[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def bin(self) -> Path:
        """The venv's ``bin/`` (console scripts such as ``vllm-mlx``)."""
        return self.python.parent


@dataclass(frozen=True, slots=True)
class ServerTarget:
    """One server: its install recipe, how it starts, and where it says what its cache did.

    ``model_name`` is what requests send as ``model``: a literal, or
    ``{model_dir}`` / ``{model_id}``, filled in by :meth:`request_model`.
    ``cached_from`` is ``usage`` (``usage.prompt_tokens_details.cached_tokens``),
    ``stats_endpoint`` (the growth of ``stats_key`` in ``GET stats_path``
    across the request) or ``none``.
    """

    name: str
    venv: str | None                                  # folder under .peers/; None = this interpreter (.venv)
    install: tuple[tuple[str, ...], ...]              # pip argument lists, run in order in a fresh venv
    command: Callable[[Launch], list[str]] | None     # None: a record, not run here
    env: Callable[[Launch], dict[str, str]]           # the target's own variables (BLAS is added by start)
    health_path: str
    model_name: str
    cached_from: str
    stats_path: str | None = None
    stats_key: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict, compare=False)
    packages: tuple[str, ...] = ()                    # the distributions whose versions results report
    platforms: frozenset[str] = LINUX_AND_MAC
    loads_blas_itself: bool = False                   # ours (semantic.blas); peers get LD_PRELOAD
    cache_key_field: str | None = None                # the request field naming a conversation's own cache
    reason: str = ""                                  # why it is not run where it is not
    notes: str = ""

    def __post_init__(self):
        if self.cached_from not in CACHED_FROM:
            raise ValueError(f"{self.name}: cached_from {self.cached_from!r} is not one of {CACHED_FROM}")
        if self.cached_from == "stats_endpoint" and not (self.stats_path and self.stats_key):
            raise ValueError(f"{self.name}: cached_from='stats_endpoint' needs stats_path and stats_key")
        if self.install and self.venv is None:
            raise ValueError(f"{self.name}: an install recipe needs its own venv")

    @property
    def runnable_here(self) -> bool:
        """Whether :func:`start` can run it on this machine."""
        return self.runnable_on(platform.system())

    def runnable_on(self, system: str) -> bool:
        """Whether it runs on ``system`` (``platform.system()``: Linux, Darwin, ...)."""
        return self.command is not None and system in self.platforms

    def request_model(self, model_dir: Path | str, model_id: str) -> str:
        """The ``model`` field its requests must send."""
        return self.model_name.format(model_dir=str(model_dir), model_id=model_id)

    def settings(self, **overrides) -> dict[str, Any]:
        """Its defaults with ``overrides`` applied; an unknown name is a ``ValueError``."""
        unknown = sorted(set(overrides) - set(self.defaults))
        if unknown:
            raise ValueError(f"{self.name} takes settings {sorted(self.defaults)}, not {unknown}")
        return {**self.defaults, **overrides}


# --- the targets --------------------------------------------------------------------------------

def _flags(settings: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
    """``--flag value`` for each setting in ``names`` that is not None."""
    out = []
    for key, flag in names.items():
        if settings.get(key) is not None:
            out += [flag, str(settings[key])]
    return out


def _semantic_command(l: Launch) -> list[str]:
    return [str(l.python), "-m", "semantic.serve", "--model", str(l.model_dir), "--model-id", l.model_id,
            "--host", l.host, "--port", str(l.port), "--cache-dir", str(l.workdir / "cache"),
            *_flags(l.settings, {"ram_mb": "--ram-mb", "disk_mb": "--disk-mb", "pool_mb": "--pool-mb"})]


def _mlx_lm_command(l: Launch) -> list[str]:
    # unset flags keep mlx-lm's own defaults (and 0.30.4's server, which has neither flag, starts)
    return [str(l.python), "-m", "mlx_lm.server", "--model", str(l.model_dir), "--host", l.host,
            "--port", str(l.port),
            *_flags(l.settings, {"prompt_cache_size": "--prompt-cache-size", "prompt_cache_bytes": "--prompt-cache-bytes"})]


def _mlx_vlm_command(l: Launch) -> list[str]:
    return [str(l.python), "-m", "mlx_vlm.server", "--model", str(l.model_dir), "--host", l.host,
            "--port", str(l.port)]


def _mlx_vlm_env(l: Launch) -> dict[str, str]:
    s = l.settings
    env = {"APC_ENABLED": "1", "APC_DISK_PATH": str(l.workdir / "apc"), "APC_BLOCK_SIZE": str(s["apc_block_size"])}
    for key, var in (("apc_memory_max_gb", "APC_MEMORY_MAX_GB"), ("apc_disk_max_gb", "APC_DISK_MAX_GB")):
        if s.get(key) is not None:
            env[var] = str(s[key])
    return env


def _vllm_mlx_command(l: Launch) -> list[str]:
    return [str(l.bin / "vllm-mlx"), "serve", str(l.model_dir), "--host", l.host, "--port", str(l.port),
            "--continuous-batching", "--ssd-cache-dir", str(l.workdir / "ssd"),
            "--ssd-cache-max-gb", str(l.settings["ssd_cache_max_gb"]),
            *_flags(l.settings, {"cache_memory_mb": "--cache-memory-mb"})]


def _vllm_mlx_env(l: Launch) -> dict[str, str]:
    # It dumps its prefix cache on SIGTERM to ~/.cache/vllm-mlx/prefix_cache/<model path> and loads it
    # at start (server.py _get_cache_dir: os.path.expanduser("~")): a HOME per workdir keeps runs apart.
    return {"HOME": str(l.workdir / "home")}


def _no_env(l: Launch) -> dict[str, str]:
    return {}


_SEMANTIC = ServerTarget(
    name="semantic", venv=None, install=(), command=_semantic_command, env=_no_env,
    health_path="/health", model_name="{model_id}", cached_from="usage",
    stats_path="/v1/cache/stats", defaults={"ram_mb": None, "disk_mb": None, "pool_mb": None},
    loads_blas_itself=True, cache_key_field="prompt_cache_key",
    packages=("semantic-kv", "mlx", "mlx-cpu", "mlx-lm", "transformers"),
    notes="ours; a request with prompt_cache_key has its agent cache saved under workdir/cache and "
          "reloaded after a restart; anonymous requests share 256-token prefix blocks in RAM only",
)

_MLX_LM = ServerTarget(
    name="mlx_lm.server", venv=None, install=(), command=_mlx_lm_command, env=_no_env,
    health_path="/health", model_name="default_model", cached_from="usage",
    # None: mlx-lm's own default (10 entries in 0.32); a "matched" run passes the caller's figures.
    defaults={"prompt_cache_size": None, "prompt_cache_bytes": None},
    packages=("mlx-lm", "mlx", "mlx-cpu", "transformers"),
    notes="in-memory LRU of prompt caches only (no disk); 'default_model' maps to --model",
)

_MLX_VLM = ServerTarget(
    name="mlx-vlm", venv="mlx-vlm",
    install=(("mlx-vlm[cpu]==0.7.10", "mlx[cpu]==0.32.4"),),
    command=_mlx_vlm_command, env=_mlx_vlm_env,
    health_path="/health", model_name="{model_dir}", cached_from="usage",
    stats_path="/v1/cache/stats",
    # APC_MEMORY_MAX_GB unset: min(8 GiB, Metal working set / 10), which is 1 GiB where MLX reports no
    # working set (apc.py); APC_DISK_MAX_GB unset: its DEFAULT_DISK_MAX_GB.
    defaults={"apc_block_size": 256, "apc_memory_max_gb": None, "apc_disk_max_gb": None},
    packages=("mlx-vlm", "mlx", "mlx-cpu", "transformers"),
    notes="automatic prefix cache (APC): RAM block tier + disk tier under workdir/apc; "
          "the request's model is a path it (re)loads, so it must equal --model exactly",
)

_VLLM_MLX = ServerTarget(
    name="vllm-mlx", venv="vllm-mlx",
    # --no-deps: its metadata also pulls gradio, torchvision and mlx-embeddings, which a text server on
    # CPU does not import; the second list is what `serve` does import (mlx-lm pinned below 0.32 as it asks).
    install=(("--no-deps", "vllm-mlx==0.6.0"),
             ("mlx[cpu]", "mlx-lm==0.31.3", "mlx-vlm==0.7.10", "transformers>=5", "fastapi", "starlette>=1.0.1",
              "uvicorn", "prometheus-client", "mcp", "jsonschema", "lm-format-enforcer", "llguidance", "psutil",
              "pyyaml", "tabulate", "requests", "pillow", "tqdm", "pytz")),
    command=_vllm_mlx_command, env=_vllm_mlx_env,
    health_path="/health", model_name="{model_dir}", cached_from="stats_endpoint",
    stats_path="/v1/cache/stats", stats_key="tokens_saved",
    # cache_memory_mb unset: --cache-memory-percent 0.20 of available RAM.
    defaults={"ssd_cache_max_gb": 4, "cache_memory_mb": None},
    packages=("vllm-mlx", "mlx", "mlx-cpu", "mlx-lm", "mlx-vlm", "transformers"),
    notes="memory-aware prefix cache reuses prefixes of >= 128 tokens; usage has no cached_tokens; "
          "dumps its cache to $HOME/.cache/vllm-mlx/prefix_cache on SIGTERM and loads it at start",
)

_OMLX = ServerTarget(
    name="omlx", venv="omlx", install=(), command=None, env=_no_env,
    health_path="/health", model_name="{model_id}", cached_from="none", platforms=frozenset({"Darwin"}),
    reason="not run here: needs macOS 15+ on Apple Silicon (Metal); no Linux build",
    notes="`omlx serve --model-dir DIR` (Homebrew or source install); paged SSD KV cache",
)

_LMSTUDIO = ServerTarget(
    name="lmstudio-mlx-engine", venv="lmstudio-mlx-engine", install=(), command=None, env=_no_env,
    health_path="/v1/models", model_name="{model_id}", cached_from="none", platforms=frozenset({"Darwin"}),
    reason="not run here: LM Studio's MLX engine needs macOS on Apple Silicon (Metal); "
           "it is served by the LM Studio app, not a pip-installable server",
)

_LLAMA_CPP = ServerTarget(
    name="llama.cpp", venv="llama.cpp", install=(("llama-cpp-python[server]",),), command=None, env=_no_env,
    health_path="/health", model_name="{model_id}", cached_from="none",
    reason="not run here: llama-cpp-python has no Linux wheel on this mirror and its sdist compiles "
           "llama.cpp (about 10 minutes on 2 cores); it also needs a GGUF file, not the MLX f32 model",
    notes="would report hits as timings.cache_n (llama-server) and serve /slots and /metrics",
)

TARGETS: dict[str, ServerTarget] = {t.name: t for t in (_SEMANTIC, _MLX_LM, _MLX_VLM, _VLLM_MLX,
                                                        _OMLX, _LMSTUDIO, _LLAMA_CPP)}


def runnable_targets(system: str | None = None) -> list[ServerTarget]:
    """The targets :func:`start` can run on ``system`` (default: this machine)."""
    system = system or platform.system()
    return [t for t in TARGETS.values() if t.runnable_on(system)]


# --- BLAS -----------------------------------------------------------------------------------------

@cache
def blas_library() -> str | None:
    """The OpenBLAS file ours loads (``semantic.blas`` with ``SEMANTIC_BLAS=auto``), or None.

    Asked of a fresh interpreter, so that this process (which may already have
    imported MLX, or chosen otherwise) changes nothing.
    """
    if platform.system() != "Linux":
        return None
    env = {**os.environ, "SEMANTIC_BLAS": "auto"}
    code = "import semantic.blas as b; c = b.enable(warn=False); print(c.path if c.status == 'loaded' else '')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          cwd=ROOT)
    if done.returncode != 0:
        raise ServingError(f"could not ask semantic.blas for its library: {done.stderr[-1000:]}")
    return done.stdout.strip() or None


def server_env(target: ServerTarget, launch: Launch, blas: str | None,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment a target's process starts with.

    Args:
        blas: the OpenBLAS file every server must use (:func:`blas_library`), or
            None for MLX's bundled BLAS everywhere.
        base: the environment to start from (default ``os.environ``).
    """
    env = dict(os.environ if base is None else base)
    for var in ("VIRTUAL_ENV", "PYTHONHOME", "SEMANTIC_BLAS"):
        env.pop(var, None)
    env["PATH"] = os.pathsep.join([str(launch.bin), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"   # local model folders only: no hub look-ups at start
    if target.loads_blas_itself:
        env["SEMANTIC_BLAS"] = "auto" if blas else "off"
    elif blas:
        # NOTE: preloaded, so first in the global scope: libmlx's cblas_* bind to it, although the
        # bundled reference libblas is still mapped (libmlx needs it by name).
        env["LD_PRELOAD"] = ":".join(filter(None, [blas, env.get("LD_PRELOAD")]))
    env.update(target.env(launch))
    return env


@dataclass(frozen=True, slots=True)
class BlasMapping:
    """Which BLAS libraries a live process has mapped (``/proc/PID/maps``)."""

    pid: int
    mapped: tuple[str, ...]      # every mapped file whose name contains "blas", sorted
    openblas: str | None         # the system libopenblas among them (numpy's private scipy_openblas is not)
    preload: str | None          # LD_PRELOAD in its environment, when readable

    def uses(self, path: str | None) -> bool:
        """Whether ``path`` (a :func:`blas_library` result) is the OpenBLAS it has mapped."""
        return path is not None and self.openblas is not None and os.path.realpath(path) == self.openblas


def blas_of(pid: int) -> BlasMapping:
    """The BLAS libraries process ``pid`` has mapped, so results can say which one each server ran on."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return BlasMapping(pid, (), None, None)
    paths = {line.split(None, 5)[5] for line in text.splitlines() if len(line.split(None, 5)) == 6}
    mapped = tuple(sorted(p for p in paths if p.startswith("/") and "blas" in p.rsplit("/", 1)[-1]))
    openblas = next((os.path.realpath(p) for p in mapped if p.rsplit("/", 1)[-1].startswith("libopenblas")), None)
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        preload = next((e[len(b"LD_PRELOAD="):].decode() for e in environ if e.startswith(b"LD_PRELOAD=")), None)
    except OSError:
        preload = None
    return BlasMapping(pid, mapped, openblas, preload)


# --- venvs --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Venv:
    """A target's interpreter and what is installed beside it."""

    python: Path
    versions: Mapping[str, str]       # every distribution: name -> version
    install_s: float | None           # seconds the recipe took when it ran; None for .venv
    installed_now: bool               # False when the stamp said it was already done

    def pick(self, names: Sequence[str]) -> dict[str, str | None]:
        """The versions of ``names`` (a target's ``packages``), None where not installed."""
        norm = {_norm(k): v for k, v in self.versions.items()}
        return {n: norm.get(_norm(n)) for n in names}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def recipe_hash(target: ServerTarget) -> str:
    """sha256 of the install recipe: a changed recipe means a fresh venv."""
    return hashlib.sha256(json.dumps([list(a) for a in target.install]).encode()).hexdigest()


def installed_versions(python: Path | str) -> dict[str, str]:
    """Every distribution ``python`` sees, name -> version (importlib.metadata, so no pip needed)."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ServingError(f"{python} could not list its packages: {done.stderr[-1000:]}")
    return dict(sorted(json.loads(done.stdout.strip().splitlines()[-1]).items(), key=lambda kv: kv[0].lower()))


def venv_dir(target: ServerTarget, root: Path = ROOT) -> Path:
    """Where a peer's venv lives: ``<root>/.peers/<venv>``."""
    if target.venv is None:
        raise ValueError(f"{target.name} runs in this interpreter's venv, not under {PEERS}/")
    return Path(root) / PEERS / target.venv


def ensure_venv(target: ServerTarget, root: Path = ROOT, *, base_python: str = "python3",
                pip: Sequence[str] | None = None) -> Venv:
    """Create ``.peers/<venv>/`` and run the install recipe once; a second call only reads the stamp.

    The stamp (``semantic-install.json``) holds the recipe's hash: a venv whose
    stamp is missing (a failed or interrupted install) or names another recipe
    is deleted and built again from nothing.

    Args:
        base_python: the interpreter that creates the venv (``python3 -m venv``).
        pip: the command that installs into the venv, each recipe line appended
            (default: the venv's own ``python -m pip``; then the venv gets pip).

    Returns:
        The :class:`Venv` with its python and exact installed versions.

    Raises:
        InstallError: a recipe line failed (with the install log's tail).
    """
    if target.venv is None:
        return Venv(Path(sys.executable), installed_versions(sys.executable), None, False)
    where = venv_dir(target, root)
    python = where / "bin" / "python"
    stamp = where / STAMP
    want = recipe_hash(target)
    if stamp.is_file():
        done = json.loads(stamp.read_text())
        if done.get("recipe_sha256") == want and python.exists():
            return Venv(python, done["versions"], done["install_s"], False)
    if where.exists():
        shutil.rmtree(where)
    where.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    create = [base_python, "-m", "venv", str(where)] + (["--without-pip"] if pip is not None else [])
    _run_logged(target, create, where.parent / f"{target.venv}.venv.log")
    log = where / "install.log"
    for args in target.install:
        _run_logged(target, [*(pip if pip is not None else [str(python), "-m", "pip"]), "install", *args], log)
    install_s = time.perf_counter() - t0
    versions = installed_versions(python)
    stamp.write_text(json.dumps({"target": target.name, "recipe": [list(a) for a in target.install],
                                 "recipe_sha256": want, "install_s": round(install_s, 3),
                                 "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions},
                                indent=1))
    return Venv(python, versions, install_s, True)


def _run_logged(target: ServerTarget, cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise InstallError(f"{target.name}: `{' '.join(cmd)}` exited {rc}; {log}:\n{_tail(log)}")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_bytes()[-chars:].decode(errors="replace")
    except OSError:
        return "(no log)"


# --- running servers ------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        return sum(_rss(pid) for pid in [self.pid, *_descendants(self.pid)])

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
        return _tail(self.log_path, chars)

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
            targets, ``.peers/<venv>/bin/python`` for peers: run :func:`ensure_venv` first).
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


def _wait_ready(running: Running, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    url = running.url + running.target.health_path
    while True:
        if running.proc.poll() is not None:
            raise ServerStartError(f"{running.target.name} exited {running.proc.returncode} before it was ready; "
                                   f"{running.log_path}:\n{running.log_tail()}")
        try:
            if _get(url, 2.0)[0] == 200:
                return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"{running.target.name} did not answer {url} within {timeout_s:.0f} s; "
                                   f"{running.log_path}:\n{running.log_tail()}")
        time.sleep(0.25)


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


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --- what the cache did ---------------------------------------------------------------------------

def usage_cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a dict or an SDK object; None when absent."""
    if usage is None:
        return None
    if hasattr(usage, "model_dump"):
        usage = usage.model_dump()
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return None if value is None else int(value)


def _sum_key(tree: Any, key: str) -> int:
    """The sum of every numeric ``key`` anywhere in a JSON tree."""
    if isinstance(tree, Mapping):
        return sum((int(v) if k == key and isinstance(v, (int, float)) else _sum_key(v, key))
                   for k, v in tree.items())
    if isinstance(tree, list):
        return sum(_sum_key(v, key) for v in tree)
    return 0


def cached_tokens(running: Running | ServerTarget, response_usage: Any = None,
                  before_stats: Mapping | None = None, after_stats: Mapping | None = None) -> int | None:
    """Prompt tokens one request took from the server's cache, as that server reports it.

    Args:
        running: the server (or its target).
        response_usage: the response's ``usage`` (dict or SDK object), for ``cached_from="usage"``.
        before_stats, after_stats: :meth:`Running.stats` just before and after the
            request, for ``cached_from="stats_endpoint"`` (one request at a time).

    Returns:
        The count, or None where the server does not say.
    """
    target = running.target if isinstance(running, Running) else running
    if target.cached_from == "usage":
        return usage_cached_tokens(response_usage)
    if target.cached_from == "stats_endpoint":
        if before_stats is None or after_stats is None:
            return None
        return _sum_key(after_stats, target.stats_key) - _sum_key(before_stats, target.stats_key)
    return None
