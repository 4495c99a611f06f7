"""The writer side of the kill test (tests/semantic/cachefile/test_cachefile_crash.py).

``python -m tests.persistence_child PATH`` builds two caches, prints
``ready``, then for each ``kill <ms>`` line on stdin forks a writer that
saves the two caches to PATH in turn, forever, and SIGKILLs it after that
many milliseconds; it prints ``killed`` once the writer is gone. Forking a
warm process makes each kill cost milliseconds instead of a fresh
interpreter's second of imports.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import mlx.core as mx

from semantic import BlockPool, LayerSpec, ModelCacheSpec, cachefile
from tests.cache_helpers import synthetic

SPEC = ModelCacheSpec((LayerSpec("global", 4, 64, 64, "float32"),) * 8)  # 16 KiB per token
FINGERPRINT = "kill-test"


def caches(pool: BlockPool):
    """The two versions the writer alternates: 1000 and 1100 tokens (about 16 MB each)."""
    a = synthetic(SPEC, pool, list(range(1, 1001)), seed=1)
    b = synthetic(SPEC, pool, list(range(2, 1102)), seed=2)
    return a, b


def _write_forever(path: str, versions) -> None:
    try:
        while True:
            for blocks in versions:
                cachefile.save(path, blocks, model_fingerprint=FINGERPRINT)
    finally:
        os._exit(1)


def main(path: str) -> None:
    versions = caches(BlockPool(SPEC, 64, block_tokens=256))
    # MLX cannot compute in a forked child (its worker threads do not survive
    # fork), and saving a block that is a strided view into its segment needs
    # a copy: make every block's bytes ready here, before forking.
    for v in versions:
        for b in v.unique_blocks():
            b.layer_data = {i: (mx.contiguous(k), mx.contiguous(vv)) for i, (k, vv) in b.layer_data.items()}
            b.segment_view = None
    mx.eval([b.layer_data for v in versions for b in v.unique_blocks()])
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd != "kill":
            break
        pid = os.fork()
        if pid == 0:
            _write_forever(path, versions)
        time.sleep(int(arg[0]) / 1000)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("killed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
