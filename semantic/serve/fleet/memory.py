"""Giving an unloaded model's memory back to the system, so that a server's RSS follows what it holds.

Two things kept an unloaded model's memory resident; measured with ``python -m harness.memory.cycles``
(Gemma 3 270M and SmolLM2 f32 switched twelve times under a budget that holds one, 128 MB pools, 700-token
prompts): RSS after each cycle grew 897 -> 1199 MB, and the largest sample reached 2086 MB, while the
models it held came to 1.3 GB:

* **glibc's heap.** MLX allocates its buffers with ``malloc``. glibc raises its mmap threshold to the size
  of each large block freed (up to 32 MiB, its trim threshold to twice that), so after the first unload a
  model's weights and KV blocks come from per-thread arenas whose free tops ``malloc_trim`` does not give
  back: about 25 MB more RSS per switch cycle (8 MB with 50 and 75 MB test models). Thresholds held fixed
  (:func:`fix_heap_thresholds`) keep large blocks in mappings of their own, unmapped when freed.
* **A collection that ran too early.** A closed service's scheduler, executor and store reference each
  other; the executor thread that ran the close drops its reference to the service just after the unload
  resumes, so the unload's one ``gc.collect`` could find the cycle still reachable (3 of 40 unloads in one run)
  and the model stayed until some later collection, beside the next one loaded: MLX's peak rose by
  300 MB. :func:`release` collects until the model's weights and pool are gone (a bounded poll), then
  empties MLX's buffer cache and trims the heap.

With both, RSS after each cycle stays within 11 MB over ten cycles (890 -> 901 MB), its largest sample
1728 MB (the first cycle's first prefill; 1383 MB in every later cycle).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from typing import Sequence

from semantic import heap

log = logging.getLogger("semantic.serve")

HEAP_THRESHOLD = 128 * 1024  # glibc's own default mmap and trim thresholds, held fixed (see the docstring)
RELEASE_WAIT_S = 5.0         # how long an unload collects for a model whose arrays something still holds
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)

_fixed = False
_fixed_lock = threading.Lock()


def fix_heap_thresholds() -> bool:
    """Hold glibc's mmap and trim thresholds at :data:`HEAP_THRESHOLD` for this process: a freed
    model's buffers go back to the system at once. Once per process; False where there is no glibc."""
    global _fixed
    with _fixed_lock:
        if not _fixed:
            mallopt = getattr(heap.libc(), "mallopt", None)
            _fixed = mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD)) \
                and bool(mallopt(_M_TRIM_THRESHOLD, HEAP_THRESHOLD))
        return _fixed


def holders(backend) -> list[weakref.ref]:
    """Weak references to what holds a backend's memory (its model's weights, its pool), for :func:`release`;
    none for a stand-in that names nothing."""
    named = getattr(backend, "holders", None)
    return [weakref.ref(o) for o in named()] if named is not None else []


def release(held: Sequence[weakref.ref] = (), wait_s: float = RELEASE_WAIT_S) -> bool:
    """Collect until everything ``held`` refers to is gone (at most ``wait_s``), then give freed memory
    back: MLX's buffer cache, then glibc's heap. False: something still holds a model after ``wait_s``
    (logged; its memory stays until that reference goes)."""
    deadline = time.monotonic() + wait_s
    gc.collect()
    while _alive(held) and time.monotonic() < deadline:
        time.sleep(0.02)  # the thread that ran the close is about to drop its last reference
        gc.collect()
    still = _alive(held)
    if still:
        log.warning("an unloaded model's memory is still referenced after %.0f s (%s): it stays resident",
                    wait_s, ", ".join(still))
    heap.give_back(keep=-1)  # always: an unloaded model's memory goes however little MLX caches
    return not still


def _alive(held: Sequence[weakref.ref]) -> list[str]:
    """The type names of what ``held`` still refers to (names only: no strong reference outlives the call)."""
    return sorted({type(o).__name__ for o in (r() for r in held) if o is not None})


def rss_bytes() -> int:
    """This process's resident set now (``VmRSS``); 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
