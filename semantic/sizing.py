"""The budgets a server sets when it is given none: from the machine's memory and disk and the model.

After LM Studio's mlx-engine (usable = working set - reserve - fixed, divided by bytes a token) with
its reserve of max(3 GiB, 5%), and its disk budget of min(30 GiB, free / 4)::

    memory      what the machine gives this process: available memory, or a cgroup's limit less its
                usage on Linux; the GPU's recommended working set on a Mac
    - reserve   max(3 GiB, 5% of the machine): the system, other processes, what the formula misses
    - fixed     every model's weights and tokenizer (``tokenizer_bytes``), and the process's runtime
                (``RUNTIME_BYTES``); measured as ``semantic.serve.fleet.footprint`` says
    - working   a step's activations at the longest context (``step_bytes``: attention scores, logits)
    = left      shared by the models, each its pool and what turns hold beyond it (``LIVE_COPY`` times
                it): a turn writes into the pool's own buffers, and the pool is charged for any copy of a
                cache a turn must make instead (admission, ``semantic.cache.manager``)

The pool's half is the KV block pool (``semantic.cache.room`` charges it); the RAM budget for caches
resident between turns is a share of it (``defaults.RAM_SHARE``). An explicit flag always wins.
"""

from __future__ import annotations

import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

from semantic import defaults
from semantic.cache import room
from semantic.cache.spec import ModelCacheSpec
from semantic.modelconfig import ModelConfig

GiB = 1 << 30
MiB = 1 << 20
RESERVE_FLOOR = 3 * GiB
RESERVE_SHARE = 0.05
DISK_CEILING = 30 * GiB
DISK_SHARE = 0.25
POOL_FLOOR = 64 * MiB            # below it a model is refused, not served badly
# the process's own: the server's imports, MLX's and BLAS's runtime, with no model loaded after one loaded,
# ran a turn and unloaded: 111 MB measured (``python -m harness.memory.costs``; 2-core x86, mlx 0.32)
RUNTIME_BYTES = 128 * MiB
# a loaded tokenizer follows its tokenizer.json: SmolLM2 (3.4 MB file) 55 MB, Gemma 3 (31.7 MB) 378-441 MB
TOKENIZER_FIXED = 16 * MiB
TOKENIZER_PER_FILE_BYTE = 14
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tiktoken.model")
TOKENIZER_BYTES = 64 * MiB       # a model whose files are not on disk (a hub id): SmolLM2's
# what turns hold beyond the pool's blocks that admission does not charge, as a share of the pool: a turn
# runs in the pool's buffers (lent), and admission charges the pool for any copy a turn makes instead
# (CacheManager.live_bytes) and for merged batches; left are a lent segment's spare slots (a 32nd of its
# tokens and a 256-slot step), the heap's free memory under its trim threshold and MLX's buffer cache.
# Before lending, a turn held its cache twice: peak active memory 2.26-2.38x the cache, counted 1.4
LIVE_COPY = 0.1
TYPICAL_AGENT = 32_768           # the agents' length the start-up line counts (a coding session's)
DEFAULT_LONGEST = 131_072        # the context a model of longer context is sized for


@dataclass(frozen=True, slots=True)
class Machine:
    """What this process may use: ``memory`` bytes now (of ``total``), as ``source`` says."""

    memory: int
    total: int
    source: str

    @classmethod
    def read(cls) -> "Machine":
        if platform.system() == "Darwin":
            return _darwin()
        return _linux()


def _linux() -> "Machine":
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    memory, source = info.get("MemAvailable", total), "available memory"
    cgroup = _cgroup()
    if cgroup is not None:
        limit, room_left = cgroup
        total = min(total, limit)
        if room_left < memory:
            memory, source = room_left, "the cgroup's memory limit less its usage"
    return Machine(memory, total, source)


def _cgroup() -> tuple[int, int] | None:
    """A cgroup's limit and that limit less its usage (v2, then v1), or None when no limit binds."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            return int(raw), max(0, int(raw) - int(Path(usage_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def _darwin() -> "Machine":
    import subprocess

    total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, check=True).stdout)
    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        wired = int(info.get("max_recommended_working_set_size") or 0)
    except Exception:  # no Metal device: the CPU build
        wired = 0
    if wired:
        return Machine(min(wired, total), total, "the GPU's recommended working set")
    return Machine(int(total * 0.75), total, "three quarters of the machine's memory")


def tokenizer_bytes(model_dir: Path | None) -> int:
    """The RSS a model's tokenizer takes once loaded: its ``tokenizer.json`` (else its other tokenizer files)
    times ``TOKENIZER_PER_FILE_BYTE``, plus ``TOKENIZER_FIXED`` (no directory: ``TOKENIZER_BYTES``)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return TOKENIZER_BYTES
    d = Path(model_dir)
    files = [d / "tokenizer.json"] if (d / "tokenizer.json").is_file() else \
        [d / n for n in TOKENIZER_FILES if (d / n).is_file()]
    return TOKENIZER_FIXED + TOKENIZER_PER_FILE_BYTE * sum(f.stat().st_size for f in files)


def disk_free(where: str | Path) -> int:
    """Free bytes on the filesystem ``where`` is (or would be) on."""
    p = Path(where).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def step_bytes(config: ModelConfig, tokens: int, chunk: int, max_batch: int = 1, drafts: int = 0) -> int:
    """A step's activations at their largest, at ``tokens`` of context: one layer's attention scores over a
    prefill chunk of ``chunk`` tokens in float32 (MLX's CPU attention materializes ``heads x chunk x tokens``;
    Metal's fused kernel needs less) or a decode step's logits (``max_batch`` rows of a token and its
    ``drafts``), whichever is larger, plus the chunk's MLP and residual-stream activations. Measured against
    RSS in ``semantic.serve.fleet.footprint``."""
    heads = config.heads or 32
    hidden = config.hidden or 0
    scores = heads * chunk * tokens * 4
    logits = max_batch * (1 + drafts) * (config.vocab or 32_000) * 4
    activations = chunk * (3 * (config.intermediate or 0) + 4 * hidden) * 4
    return max(scores, logits) + activations


@dataclass(frozen=True, slots=True)
class Share:
    """How much of the memory one of several models may size itself from: ``memory`` bytes for all
    (None: the machine's, less the reserve), shared by ``models``, whose other fixed bytes are
    ``others_fixed``."""

    memory: int | None = None
    models: int = 1
    others_fixed: int = 0


@dataclass(frozen=True, slots=True)
class Budgets:
    """One model's share of the machine, and what it holds (the start-up line: :meth:`describe`)."""

    machine: Machine
    reserve: int
    fixed: int           # weights, tokenizer, runtime
    working: int         # a chunk's activations at the longest context
    pool: int            # the KV block pool
    ram: int             # caches resident between turns
    disk: int            # cache files
    longest: int         # tokens in one agent's cache
    agents: int          # agents of ``typical`` tokens the pool holds at once
    typical: int = TYPICAL_AGENT  # TYPICAL_AGENT, or the longest cache when that is shorter
    models: int = 1

    def describe(self) -> str:
        gib = lambda b: f"{b / GiB:.1f} GiB"
        share = f", shared by {self.models} models" if self.models > 1 else ""
        return (f"memory: {gib(self.machine.memory)} ({self.machine.source}) less a {gib(self.reserve)} reserve, "
                f"{gib(self.fixed)} of weights, tokenizer and runtime and {gib(self.working)} of working memory"
                f"{share}: a {gib(self.pool)} KV pool (RAM budget {gib(self.ram)}, disk {gib(self.disk)}) holds one "
                f"agent of {self.longest:,} tokens or {self.agents} of {self.typical:,}")


def derive(spec: ModelCacheSpec, config: ModelConfig, *, weights: int, machine: Machine, disk_free_bytes: int,
           context: int | None = None, block_tokens: int = defaults.BLOCK_TOKENS, chunk: int = 64,
           share: Share = Share(), tokenizer: int = TOKENIZER_BYTES) -> Budgets:
    """The pool, RAM and disk budgets of one model of ``weights`` bytes (one of ``share.models`` sharing
    ``share.memory``), serving ``context`` tokens at most (None: its config's)."""
    context = min(context or config.context, config.context)
    memory, models, others_fixed = share.memory, share.models, share.others_fixed
    if memory is None:
        reserve = max(RESERVE_FLOOR, int(RESERVE_SHARE * machine.total))
        memory = machine.memory - reserve
    else:
        reserve = 0
    fixed = weights + tokenizer + RUNTIME_BYTES
    want = min(context, DEFAULT_LONGEST)
    working = step_bytes(config, want, chunk)
    left = memory - fixed - others_fixed - working
    pool = max(0, int(left / ((1 + LIVE_COPY) * models)))
    longest = min(room.longest_cache(spec, pool, block_tokens), context)
    if longest < want:  # the chunk's scores shrink with the context they cover: size them again
        working = step_bytes(config, longest, chunk)
        pool = max(0, int((memory - fixed - others_fixed - working) / ((1 + LIVE_COPY) * models)))
        longest = min(room.longest_cache(spec, pool, block_tokens), context)
    typical = min(TYPICAL_AGENT, longest)
    agents = pool // room.cache_bytes(spec, typical, block_tokens) if typical else 0
    disk = int(min(DISK_CEILING, disk_free_bytes * DISK_SHARE))
    return Budgets(machine, reserve, fixed, working, int(pool), int(pool * defaults.RAM_SHARE), disk, longest,
                   int(agents), typical, models)
