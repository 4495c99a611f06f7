"""A save of the block layout killed at any moment leaves the old history or the new one, exactly.

The writer is another process (tests/store_blocks_child.py): it dies at a chosen point between its
block files and its manifest, or is SIGKILLed at random moments while it saves two histories in
turn. A restarted store then loads one of the two exactly, and leaves no temporary file and no
block file that its manifest does not name.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from semantic import AgentCacheStore, BlockPool
from semantic.store import manifest, manifest_name
from tests import store_blocks_child as child
from tests.cache_helpers import assert_identical
from tests.semantic.store.test_blocklayout import _names

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[3]
KILLS = 40       # at least; more, up to MOST_KILLS, until kills have landed in every phase
MOST_KILLS = 200  # a busy machine shifts the phases the seeded delays land in
MAX_DELAY_MS = 120
SEED = 38  # a durable save of either history takes some 5 to 40 ms here: kills land in every phase


def _restart(directory: Path):
    """A store over ``directory`` after a crash, the two histories, and what it loads."""
    pool = BlockPool(child.SPEC, 64, block_tokens=child.BLOCK_TOKENS)
    old, new = child.versions(pool)
    store = AgentCacheStore(directory, child.SPEC, child.FINGERPRINT, 10**9, pool=pool, durable=True)
    assert list(directory.rglob("*.tmp")) == []
    m = manifest.read(str(directory / manifest_name("a")), child.SPEC, child.FINGERPRINT, child.BLOCK_TOKENS)
    assert {p.name for p in directory.glob("blocks-*/*.kvb")} == _names(m)  # no block file nothing names
    assert store.stats().quarantined == 0
    return store, old, new


@pytest.mark.parametrize("point", child.POINTS)
def test_a_save_killed_between_its_block_files_and_its_manifest_leaves_the_old_history_or_the_new_one(tmp_path, point):
    done = subprocess.run([sys.executable, "-m", "tests.store_blocks_child", str(tmp_path), point],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == child.CRASHED, done.stdout + done.stderr
    left = {p.name for p in tmp_path.rglob("*.tmp")}
    assert bool(left) == (point in ("mid-block", "before-manifest-rename")), left

    store, old, new = _restart(tmp_path)
    assert sorted(Path(p).name for p in store.cleaned) == sorted(left) and store.stats().collected > 0
    assert_identical(store.load("a"), new if point == "after-manifest-rename" else old)


def test_a_writer_killed_at_random_moments_leaves_the_old_history_or_the_new_one(tmp_path):
    writer = subprocess.Popen([sys.executable, "-m", "tests.store_blocks_child", str(tmp_path), "soak"],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        rng = random.Random(SEED)
        seen = {"none": 0, "old": 0, "new": 0, "interrupted": 0}
        for k in range(MOST_KILLS):
            if k >= KILLS and seen["old"] and seen["new"] and seen["interrupted"]:
                break
            writer.stdin.write(f"kill {rng.randint(0, MAX_DELAY_MS)}\n")
            writer.stdin.flush()
            assert writer.stdout.readline().strip() == "killed"
            seen["interrupted"] += any(tmp_path.rglob("*.tmp"))
            if not (tmp_path / manifest_name("a")).exists():
                assert not (seen["old"] or seen["new"]), "a saved history disappeared"
                seen["none"] += 1
                continue
            store, old, new = _restart(tmp_path)
            loaded = store.load("a")
            version = old if loaded.token_ids == old.token_ids else new
            assert_identical(loaded, version)
            seen["old" if version is old else "new"] += 1
        assert seen["old"] and seen["new"] and seen["interrupted"], seen
    finally:
        writer.stdin.close()
        writer.wait(timeout=60)
