"""The server's settings, checked once when built (from the command line or a test)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from semantic import defaults
from semantic.decode.promptlookup import SpecConfig

MB = 1 << 20
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(slots=True)
class ServeConfig:
    """Everything ``semantic serve`` was told; sizes in MiB as on the command line.

    ``api_keys`` empty: no authentication (every caller is tenant ``""``).
    ``graceful_s`` bounds how long shutdown waits for in-flight streams before
    cancelling them; ``shutdown_s`` bounds the backend's own close (saves).
    """

    model: str | None = None           # one model, today's server (the first of ``models`` when both)
    model_id: str | None = None
    models: tuple[str, ...] = ()       # --model [ID=]DIR_OR_HUB_ID, repeatable
    models_file: str | None = None     # a TOML of models, their options and aliases (semantic.serve.fleet.registry)
    models_dir: str | None = None      # every model folder under it, by its folder name
    aliases: tuple[str, ...] = ()      # PATTERN=ID
    pins: tuple[str, ...] = ()         # loaded at start, never unloaded
    models_mb: int | None = None       # the server's RSS: runtime, kept tokenizers, loaded models (None: no bound)
    idle_ttl_s: float = 0.0            # unload a model idle this long (0: never)
    kv_bits: int | None = None         # quantized KV caches
    host: str = "127.0.0.1"
    port: int = 8000
    cache_dir: str | None = None
    cache_layout: str = "blocks"       # blocks: each block written once, a manifest per agent; file: one file per agent
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never in logs
    pool_mb: int | None = None  # None: sized from the machine's memory and the model (semantic.sizing)
    ram_mb: int | None = None  # None: a share of the pool (defaults.RAM_SHARE), so the budget binds
    disk_mb: int | None = None  # None: min(30 GiB, a quarter of the disk's free space) (semantic.sizing)
    max_batch: int = defaults.MAX_BATCH
    max_queued: int = defaults.MAX_QUEUED
    max_context: int | None = None
    prefill_chunk: int | None = None  # prompt tokens per step, fixed; None: a step budget (semantic.runner.stepbudget)
    itl_target_ms: float | None = None  # with the budget: the step time held while others decode
    max_body_mb: float = 4.0
    log_level: str = "info"
    graceful_s: float = 10.0
    shutdown_s: float = 30.0
    sync_saves: bool = False   # reply only once the agent's cache is on disk (survives a SIGKILL)
    keep_billing_header: bool = False  # keep Claude Code's per-request system line (every prefix then misses)
    tool_parser: str | None = None     # the model's tool-call format; None: what mlx-lm sniffs from its template
    echo_history: bool = True          # an echoed reply is the agent's generated ids, not a re-render
    strict_max_tokens: bool = False    # refuse a max_tokens the context cannot hold, instead of cutting it
    speculation: bool = True           # greedy turns verify tokens copied from their context (semantic.decode.promptlookup)
    spec_max_draft: int = 8            # the most tokens drafted per step
    remote: str | None = None          # redis://host:port/db: a cache tier shared with other servers
    remote_mb: int = 0                 # the most MiB of this model's caches kept there (0: Redis's maxmemory only)

    def __post_init__(self):
        self.models = tuple(self.models)
        if self.model is not None:
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError("model must name a model directory or hub id")
            self.models = (self.model, *[m for m in self.models if m != self.model])
        if not self.models and self.models_file is None and self.models_dir is None:
            raise ValueError("give a model: --model DIR_OR_HUB_ID (repeatable as ID=DIR), --models-file or --models-dir")
        if any(not isinstance(m, str) or not m.strip() for m in self.models):
            raise ValueError("every --model must name a model directory or hub id")
        self.aliases, self.pins = tuple(self.aliases), tuple(self.pins)
        if self.models_mb is not None:
            _positive_int("models_mb", self.models_mb)
        if isinstance(self.idle_ttl_s, bool) or not isinstance(self.idle_ttl_s, (int, float)) or self.idle_ttl_s < 0:
            raise ValueError(f"idle_ttl_s must be a number of seconds >= 0 (0: never), got {self.idle_ttl_s!r}")
        if self.kv_bits is not None and self.kv_bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8, got {self.kv_bits!r}")
        if self.cache_layout not in ("blocks", "file"):
            raise ValueError(f"cache_layout must be 'blocks' or 'file', got {self.cache_layout!r}")
        if self.cache_layout == "file" and self.remote:
            raise ValueError("--remote shares caches in the blocks layout: drop --cache-layout file")
        if not isinstance(self.host, str) or not self.host.strip() or any(c.isspace() for c in self.host):
            raise ValueError(f"host must be a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in [1, 65535], got {self.port!r}")
        self.api_keys = tuple(self.api_keys)
        if any(not isinstance(k, str) or not k or k != k.strip() for k in self.api_keys):
            raise ValueError("api keys must be non-empty strings without surrounding spaces")
        for name in ("max_batch", "max_queued", "spec_max_draft"):
            _positive_int(name, getattr(self, name))
        for name in ("pool_mb", "disk_mb", "ram_mb", "max_context", "prefill_chunk"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.itl_target_ms is not None:
            if isinstance(self.itl_target_ms, bool) or not isinstance(self.itl_target_ms, (int, float)) \
                    or not self.itl_target_ms > 0:
                raise ValueError(f"itl_target_ms must be a positive number, got {self.itl_target_ms!r}")
            if self.prefill_chunk is not None:
                raise ValueError("--itl-target-ms sizes the prefill chunk itself: drop --prefill-chunk")
        for name in ("max_body_mb", "graceful_s", "shutdown_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.ram_mb is not None and self.pool_mb is not None and self.ram_mb > self.pool_mb:
            raise ValueError(f"ram_mb {self.ram_mb} exceeds pool_mb {self.pool_mb}: the pool holds every resident "
                             "cache, so such a budget never binds; lower --ram-mb or raise --pool-mb")
        if self.remote is not None and not str(self.remote).startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"remote must be a redis://, rediss:// or unix:// URL, got {self.remote!r}")
        if not isinstance(self.remote_mb, int) or self.remote_mb < 0:
            raise ValueError(f"remote_mb must be an integer >= 0, got {self.remote_mb!r}")
        if self.remote_mb and self.remote is None:
            raise ValueError("remote_mb bounds the shared tier: give --remote too")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.log_level = self.log_level.lower()

    @property
    def spec_config(self) -> SpecConfig | None:
        if not self.speculation:
            return None
        return SpecConfig(max_draft=self.spec_max_draft, position_cost=defaults.spec_position_cost())

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * MB)

    @property
    def log_level_number(self) -> int:
        return logging.getLevelName(self.log_level.upper())


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
