"""A writer SIGKILLed at random moments never leaves a partial file under the real name."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from semantic import BlockPool, cachefile
from tests.cache_helpers import assert_identical
from tests.persistence_child import SPEC, caches

ROOT = Path(__file__).resolve().parents[3]
KILLS = 60
MAX_DELAY_MS = 150  # a 16 MB save with fsync takes about 30 to 60 ms here: kills land in every phase


def test_a_writer_killed_at_any_moment_leaves_no_file_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "agent.safetensors"
    versions = caches(BlockPool(SPEC, 64, block_tokens=256))
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.persistence_child", str(path)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        rng = random.Random(2026)
        seen = Counter()
        for _ in range(KILLS):
            child.stdin.write(f"kill {rng.randint(0, MAX_DELAY_MS)}\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "killed"
            leftovers = [n for n in os.listdir(tmp_path) if n != path.name]
            assert all(n.startswith(f".{path.name}.") and n.endswith(".tmp") for n in leftovers), leftovers
            seen["interrupted mid-write"] += bool(leftovers)
            for n in leftovers:
                os.unlink(tmp_path / n)
            if not path.exists():
                assert not (seen["old"] or seen["new"]), "a complete file disappeared"
                seen["absent"] += 1
                continue
            loaded = cachefile.load(path, BlockPool(SPEC, 64, block_tokens=256))
            version = next(v for v in versions if v.token_ids == loaded.token_ids)
            assert_identical(loaded, version)
            # the writer alternates the two, so each is in turn the old file and the new one
            seen["old" if version is versions[0] else "new"] += 1
        assert seen["old"] and seen["new"] and seen["interrupted mid-write"], seen
    finally:
        child.stdin.close()
        child.wait(timeout=30)
