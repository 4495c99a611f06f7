"""Pure arithmetic and readings for EXP-017: process I/O counters, KV bytes per token, write amplification,
a cache directory's bytes on disk, and ratios of medians between two layouts."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

IO_FIELDS = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes", "cancelled_write_bytes")


def parse_proc_io(text: str) -> dict[str, int]:
    """``/proc/<pid>/io`` as a dict of its counters (``write_bytes``: bytes the process caused to be
    written to storage, charged when a page is dirtied, so a save counts in full once its writes return)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip():
            out[key.strip()] = int(value.strip())
    missing = [k for k in ("write_bytes", "wchar") if k not in out]
    if missing:
        raise ValueError(f"not a /proc/<pid>/io text: no {', '.join(missing)} in {text[:200]!r}")
    return out


def read_proc_io(pid: int) -> dict[str, int]:
    """The counters of process ``pid`` (all its threads: the saver's writes included)."""
    return parse_proc_io(Path(f"/proc/{pid}/io").read_text())


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in IO_FIELDS if k in before and k in after}


def kv_bytes_per_token(stats: dict) -> float:
    """Bytes of KV one token takes, from ``GET /v1/cache/stats``: the pool's capacity over its tokens
    (``pool.capacity_bytes`` is ``total_blocks`` blocks of ``block_tokens`` tokens at the spec's bytes
    per token; a ``kv_bytes_per_token`` field, where a server reports one, is taken as it is)."""
    pool = stats["pool"]
    direct = pool.get("kv_bytes_per_token", stats.get("kv_bytes_per_token"))
    if direct:
        return float(direct)
    tokens = pool["total_blocks"] * pool["block_tokens"]
    if tokens <= 0:
        raise ValueError(f"an empty pool reports no bytes per token: {pool}")
    return pool["capacity_bytes"] / tokens


def added_tokens(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """KV tokens a turn added to its agent's cache: its prompt beyond what was cached, and its reply but the
    last token (never fed, so never in a cache)."""
    return max(0, prompt_tokens - cached_tokens) + max(0, completion_tokens - 1)


def write_amplification(written_bytes: int, tokens_added: int, bytes_per_token: float) -> float:
    """Bytes written for a turn over the bytes of KV it added (1.0: each new token's KV written once)."""
    if tokens_added <= 0 or bytes_per_token <= 0:
        raise ValueError(f"a turn that added {tokens_added} tokens at {bytes_per_token} B each has no ratio")
    return written_bytes / (tokens_added * bytes_per_token)


def summary(values: list[float]) -> dict:
    """max, mean and median of a list of ratios (None each for an empty list)."""
    if not values:
        return {"max": None, "mean": None, "median": None, "n": 0}
    return {"max": max(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "n": len(values)}


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median of a[i] / b[i]: pairs measured next to each other (one rep of two layouts, a turn and its
    quiet twin), so that a machine whose load drifts over the run moves both sides of each pair alike."""
    if not a or len(a) != len(b):
        raise ValueError(f"paired ratios need pairs: {len(a)} against {len(b)} samples")
    return statistics.median(x / y for x, y in zip(a, b))


def median_ratio(a: list[float], b: list[float]) -> float:
    """median(a) / median(b): a layout against the other over interleaved repetitions."""
    if not a or not b:
        raise ValueError("a ratio of medians needs samples on both sides")
    return statistics.median(a) / statistics.median(b)


@dataclass(frozen=True, slots=True)
class DiskUsage:
    """A cache directory's regular files: their sizes (``bytes``), what the filesystem allocated for them
    (``allocated``), and, of both, what lies under a quarantine directory (counted, not excluded)."""

    bytes: int
    allocated: int
    files: int
    quarantine_bytes: int
    quarantine_files: int

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "allocated": self.allocated, "files": self.files,
                "quarantine_bytes": self.quarantine_bytes, "quarantine_files": self.quarantine_files}


def disk_usage(root: Path | str, quarantine_names: tuple[str, ...] = ("quarantine",)) -> DiskUsage:
    """Walk ``root`` (links not followed) and sum its regular files."""
    total = alloc = files = q_bytes = q_files = 0
    root = Path(root)
    for dirpath, _dirs, names in os.walk(root):
        quarantined = any(part in quarantine_names for part in Path(dirpath).relative_to(root).parts)
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # a temporary renamed or removed under the walk
                continue
            if not os.path.isfile(os.path.join(dirpath, name)) or os.path.islink(os.path.join(dirpath, name)):
                continue
            total += st.st_size
            alloc += st.st_blocks * 512
            files += 1
            if quarantined:
                q_bytes += st.st_size
                q_files += 1
    return DiskUsage(total, alloc, files, q_bytes, q_files)


def ideal_shared_bytes(bytes_per_token: float, shared_tokens: int, own_tokens: list[int]) -> float:
    """One copy of the shared prompt plus each agent's own tokens (its prompt beyond it, and its reply)."""
    return bytes_per_token * (shared_tokens + sum(own_tokens))
