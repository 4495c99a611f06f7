"""From the checked command line to the fleet: the registry, how one model opens, what it costs before it does."""

from __future__ import annotations

import json
from pathlib import Path

from semantic import defaults, sizing
from semantic.modelconfig import ModelConfig
from semantic.serve.config import MB, ServeConfig
from semantic.serve.fleet import footprint
from semantic.serve.fleet.fleet import Fleet
from semantic.serve.fleet.registry import ModelEntry, ModelOptions, Registry, build


def registry_of(config: ServeConfig) -> Registry:
    """The served models the flags name; raises RegistryError (a ValueError) naming the flag to fix."""
    flags = ModelOptions(idle_ttl_s=config.idle_ttl_s or None, max_context=config.max_context,
                         kv_bits=config.kv_bits, tool_parser=config.tool_parser)
    return build(list(config.models), model_id=config.model_id, models_file=config.models_file,
                 models_dir=config.models_dir, aliases=list(config.aliases), pins=list(config.pins), defaults=flags)


def pool_mb(entry: ModelEntry, config: ServeConfig) -> int | None:
    """The model's pool_mb, else the flag's; None: sized from the machine (``semantic.sizing``)."""
    return entry.options.pool_mb or config.pool_mb


def ram_budget_bytes(entry: ModelEntry, config: ServeConfig) -> int | None:
    """The model's own ram_mb, else the flag's when its pool can hold it, else a share of its pool
    (None: a pool sized from the machine, which sets the budget with it)."""
    pool = pool_mb(entry, config)
    ram = entry.options.ram_mb if entry.options.ram_mb is not None else config.ram_mb
    if pool is None:
        return ram * MB if ram is not None else None
    return ram * MB if ram is not None and ram <= pool else int(pool * MB * defaults.RAM_SHARE)


def share_of(entry: ModelEntry, config: ServeConfig, registry: Registry) -> sizing.Share:
    """The memory a model sizes its own budgets from: ``--models-mb`` (else the machine's), shared by every
    model the server may hold, whose weights and tokenizers it counts as fixed."""
    others = [footprint.footprint(Path(e.source).expanduser(), 0) for e in registry.entries.values() if e is not entry]
    return sizing.Share(memory=config.models_mb * MB if config.models_mb else None, models=1 + len(others),
                        others_fixed=sum(f.weights + f.tokenizer for f in others))


def estimate_bytes(entry: ModelEntry, config: ServeConfig, registry: Registry | None = None) -> int:
    """Before a load, what its unload gives back: the weight files on disk, the model's pool and a turn's
    working memory (``footprint``; a hub id not on disk: its pool only)."""
    return footprint_of(entry, config, registry).loaded


def kept_bytes(entry: ModelEntry, config: ServeConfig, registry: Registry | None = None) -> int:
    """What a model's first load keeps across its unloads: its tokenizer (``open_backend`` keeps it)."""
    return footprint_of(entry, config, registry).tokenizer


def footprint_of(entry: ModelEntry, config: ServeConfig, registry: Registry | None = None) -> footprint.Footprint:
    """The model's footprint at its pool: ``--pool-mb``, else its share of ``--models-mb`` as ``semantic.sizing``
    will size it (no budget: the pool is not counted, since nothing is checked against it)."""
    where = Path(entry.source).expanduser()
    pool = pool_mb(entry, config)
    if pool is not None:
        pool_bytes = pool * MB
    elif config.models_mb:
        mine = footprint.footprint(where, 0)
        share = share_of(entry, config, registry) if registry is not None else sizing.Share(config.models_mb * MB)
        left = share.memory - sizing.RUNTIME_BYTES - share.others_fixed - mine.weights - mine.tokenizer
        pool_bytes = max(0, int(left / ((1 + sizing.LIVE_COPY) * share.models)))
    else:
        pool_bytes = 0
    return footprint.footprint(where, pool_bytes, chunk=config.prefill_chunk, max_batch=config.max_batch)


def context_of(entry: ModelEntry) -> int | None:
    """Before a load: the context the model will serve (its config's, under its max_context), if its dir says."""
    config = ModelConfig.read(Path(entry.source).expanduser())
    native = config.int("max_position_embeddings") if config is not None else None
    if native is None:
        return entry.options.max_context
    return min(native, entry.options.max_context or native)


def cache_key(entry: ModelEntry, config: ServeConfig) -> str:
    """The model's cache directory (weights and config fingerprint, KV bits): two models with one key would
    share it, which one store per directory never allows."""
    from semantic import compat
    from semantic.service import model_fingerprint

    bits = f"-kv{entry.options.kv_bits}" if entry.options.kv_bits else ""
    return str(Path(config.cache_dir or "~/.cache/semantic-kv/agents").expanduser()
               / (model_fingerprint(compat.model_path(entry.source)) + bits))


def precheck(entry: ModelEntry, config: ServeConfig, several: bool) -> str | None:
    """Before room is made for a load: what would make it fail (a missing path, a directory mlx-lm cannot
    load) raises now; then the model's cache directory when several models share a server."""
    from semantic import compat

    where = Path(entry.source).expanduser()
    if entry.source.startswith(("/", "~", "./", "../")) and not where.is_dir():
        raise FileNotFoundError(f"no model directory at {entry.source}")
    if where.is_dir():
        compat.check_model_dir(where)
        weights = sorted(where.glob("*.safetensors"))
        if not weights:
            raise ValueError(f"{where} holds no .safetensors weights (a GGUF or PyTorch checkpoint: convert it "
                             "with mlx_lm.convert, or harness's converter for GGUF)")
        for file in weights:
            _check_safetensors(file)
    return cache_key(entry, config) if several else None


def _check_safetensors(file: Path) -> None:
    """A safetensors file whose header parses and whose tensors end where the file does (a copy cut short
    fails here, not after a server unloaded another model to make room for it)."""
    import struct

    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("its header is longer than the file")
            header = json.loads(f.read(n))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{file} is not a readable safetensors file ({exc})") from None
    if 8 + n + max(ends, default=0) != size:
        raise ValueError(f"{file} is cut short or padded: its tensors end at byte {8 + n + max(ends, default=0)}, "
                         f"the file has {size}")


def open_backend(entry: ModelEntry, config: ServeConfig, several: bool, tokenizers: dict | None = None,
                 share: sizing.Share = sizing.Share()):
    """Load one model as a Backend with its options over the server's flags. Blocking. ``tokenizers``:
    kept across unloads by source, so a model loaded again reads only its weights. ``share``: the memory
    its budgets are sized from when the flags give none."""
    from semantic.serve.turn.backend import Backend

    o = entry.options
    kept = tokenizers.get(entry.source) if tokenizers is not None else None
    pool, disk = pool_mb(entry, config), o.disk_mb or config.disk_mb
    backend = Backend.from_model(
        entry.source, model_id=entry.id, sync_saves=config.sync_saves,
        cache_dir=None if several else config.cache_dir, cache_root=config.cache_dir if several else None,
        cache_layout=config.cache_layout, kv_bits=o.kv_bits, tokenizer=kept,
        pool_bytes=pool * MB if pool else None, disk_budget_bytes=disk * MB if disk else None, share=share,
        ram_budget_bytes=ram_budget_bytes(entry, config), max_batch=config.max_batch,
        max_queued=config.max_queued, max_context=o.max_context, prefill_chunk=config.prefill_chunk,
        tool_parser=o.tool_parser, itl_target_s=config.itl_target_ms / 1000 if config.itl_target_ms else None,
        echo_history=config.echo_history, strict_max_tokens=config.strict_max_tokens,
        speculation=config.spec_config, remote=config.remote, remote_budget_bytes=config.remote_mb * MB)
    backend.pool_bytes = backend.service.store.capacity
    if tokenizers is not None:
        tokenizers[entry.source] = backend.service.tokenizer
    return backend


def responses_dir(config: ServeConfig) -> Path:
    """Where a server of several models keeps stored responses (one model: beside its caches, as before)."""
    root = Path(config.cache_dir).expanduser() if config.cache_dir else Path.home() / ".cache" / "semantic-kv"
    return root / "responses"


def fleet_of(config: ServeConfig) -> Fleet:
    """The fleet the flags ask for, nothing loaded yet (``Fleet.preload`` the pinned ones before serving)."""
    registry = registry_of(config)
    several = not registry.single
    tokenizers: dict = {}  # a model's tokenizer outlives its unload: a reload reads only the weights
    fleet = Fleet(registry, lambda e: open_backend(e, config, several, tokenizers, share_of(e, config, registry)),
                  budget_bytes=config.models_mb * MB if config.models_mb else None,
                  estimate=lambda e: estimate_bytes(e, config, registry), context_of=context_of,
                  check=lambda e: precheck(e, config, several), shutdown_s=config.shutdown_s,
                  responses_dir=responses_dir(config) if several else None,
                  kept=lambda e: kept_bytes(e, config, registry), runtime_bytes=sizing.RUNTIME_BYTES)
    return fleet


def pinned(fleet: Fleet) -> list[str]:
    return [i for i, e in fleet.registry.entries.items() if e.options.pinned]
