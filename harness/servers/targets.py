"""The servers EXP-009 compares, as records: how to install, start, probe and read cache hits from each.

Every target runs as a subprocess on 127.0.0.1 with all its state in one
``workdir`` (log, cache folders, and for vllm-mlx its ``HOME``): a fresh
workdir is a cold server, the same workdir again is a restart
(``harness.servers.processes``).

Peers that need macOS and Metal (oMLX, LM Studio's mlx-engine) and llama.cpp
are records with ``command=None``: :attr:`ServerTarget.runnable_here` says no
and ``reason`` says why. A macOS run adds their command and platform.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHED_FROM = ("usage", "stats_endpoint", "none")
LINUX_AND_MAC = frozenset({"Linux", "Darwin"})
OURS = "semantic"          # every ratio EXP-009 reports is ours over a peer's
MLX_LM = "mlx_lm.server"   # the peer users of MLX already run: some checks compare with it alone


class ServingError(RuntimeError):
    """Base of the serving harness's errors (a failed install, a server that did not start, ...)."""


def log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a log file, for the message of an error that names it."""
    try:
        return path.read_bytes()[-chars:].decode(errors="replace")
    except OSError:
        return "(no log)"


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
    # per accepted request, in order, (prompt, cached) tokens from the server's own log, for a server whose
    # usage reports neither (EXP-012 reads it after the run); None: usage and the stats endpoint say it
    log_usage: Callable[[str], list[tuple[int, int]]] | None = None
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
        """Whether :func:`~harness.servers.processes.start` can run it on this machine."""
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
    return [str(l.python), "-m", "semantic.serve", *_semantic_models(l),
            "--host", l.host, "--port", str(l.port), "--cache-dir", str(l.workdir / "cache"),
            *_flags(l.settings, {"ram_mb": "--ram-mb", "disk_mb": "--disk-mb", "pool_mb": "--pool-mb"}),
            *(["--no-echo-history"] if l.settings.get("echo_history") is False else []),
            *(["--no-speculation"] if l.settings.get("speculation") is False else []),
            *[a for key in l.settings.get("api_keys") or () for a in ("--api-key", key)]]


def _semantic_models(l: Launch) -> list[str]:
    """``--model DIR --model-id ID``, or with the ``models`` setting (``{id: dir}``) several models, the
    first the default, and the ``aliases`` setting's ``--alias PATTERN=ID`` (issue 40's fleet)."""
    models = l.settings.get("models")
    if not models:
        return ["--model", str(l.model_dir), "--model-id", l.model_id]
    return [*[a for mid, path in models.items() for a in ("--model", f"{mid}={path}")],
            *[a for glob, mid in (l.settings.get("aliases") or {}).items() for a in ("--alias", f"{glob}={mid}")]]


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


_VLLM_FETCH = re.compile(r"\[cache_fetch\] request=\S+ (HIT|MISS) prompt_tokens=(\d+)(?: cached=(\d+))?")


def _vllm_mlx_log_usage(log_text: str) -> list[tuple[int, int]]:
    # its scheduler logs each admitted request's prompt and cached tokens; its Anthropic usage says input_tokens 0
    return [(int(m[2]), int(m[3] or 0)) for m in _VLLM_FETCH.finditer(log_text)]


def _no_env(l: Launch) -> dict[str, str]:
    return {}


_SEMANTIC = ServerTarget(
    name=OURS, venv=None, install=(), command=_semantic_command, env=_no_env,
    health_path="/health", model_name="{model_id}", cached_from="usage",
    stats_path="/v1/cache/stats", defaults={"ram_mb": None, "disk_mb": None, "pool_mb": None, "echo_history": None, "api_keys": None,
                                                 "speculation": None, "models": None, "aliases": None},
    loads_blas_itself=True, cache_key_field="prompt_cache_key",
    packages=("semantic-kv", "mlx", "mlx-cpu", "mlx-lm", "transformers"),
    notes="ours; a request with prompt_cache_key has its agent cache saved under workdir/cache and "
          "reloaded after a restart; anonymous requests share 256-token prefix blocks in RAM only",
)

_MLX_LM = ServerTarget(
    name=MLX_LM, venv=None, install=(), command=_mlx_lm_command, env=_no_env,
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
    log_usage=_vllm_mlx_log_usage,
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
    """The targets :func:`~harness.servers.processes.start` can run on ``system`` (default: this machine)."""
    system = system or platform.system()
    return [t for t in TARGETS.values() if t.runnable_on(system)]
