"""A server's RSS across model switches (``semantic.serve.fleet.memory``, ``footprint``): an unloaded model's
memory goes back to the system, and ``--models-mb`` sized by the server's own estimate holds the process.

Two random-weight llamas of 50 and 75 MB (big enough for a model left resident to show), switched in a fleet
whose budget holds one, a named agent's turn on each: ``harness/memory/cycles.py``, in a process of its own
(RSS is the process's: a pytest worker's would count every model the suite loaded), sampled every 20 ms.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from harness.models.tiny import write_tiny_llama
from semantic.serve.fleet import footprint
from semantic.serve.fleet.memory import holders, release

MB = 1 << 20
POOL_MB = 32
CYCLES = 12
FLAT_MB = 16        # RSS after the last cycle over RSS after the second (measured: +2 to +6 MB; unfixed: +100)
OVER_BUDGET = 1.05  # every sample within --models-mb, 5% for what a 20 ms sample and the estimates' rounding miss
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4)
ROOT = Path(__file__).resolve().parents[4]


def test_rss_stays_flat_and_within_models_mb_while_two_models_switch_twelve_times(tmp_path):
    a = write_tiny_llama(tmp_path / "a", seed=1, layers=6, **SHAPE)
    b = write_tiny_llama(tmp_path / "b", seed=2, layers=4, **SHAPE)
    sizes = [footprint.footprint(d, POOL_MB * MB) for d in (a, b)]
    fixed = footprint.RUNTIME_BYTES + sum(s.tokenizer for s in sizes)
    budget_mb = math.ceil((fixed + max(s.loaded for s in sizes)) / MB)
    assert fixed + sum(s.loaded for s in sizes) > budget_mb * MB, "the budget must hold one model, never both"

    out = tmp_path / "cycles.json"
    run = subprocess.run([sys.executable, "-m", "harness.memory.cycles", str(a), str(b), "--models-mb",
                          str(budget_mb), "--pool-mb", str(POOL_MB), "--cycles", str(CYCLES), "--json", str(out),
                          "--cache-dir", str(tmp_path / "agents")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    cycles, samples = doc["cycles"], doc["samples"]
    report = run.stdout

    assert len(cycles) == CYCLES and all(c["loaded"] == ["b"] for c in cycles), report
    assert cycles[-1]["fleet"]["loads"] == 2 * CYCLES and cycles[-1]["fleet"]["unloads"] == 2 * CYCLES - 1, report
    rss = [c["rss_bytes"] for c in cycles]
    grew = (rss[-1] - rss[1]) / MB
    assert grew <= FLAT_MB, f"RSS grew {grew:.1f} MB over {CYCLES - 2} cycles\n{report}"
    peak = max(r for _, _, r in samples)
    assert len(samples) > 100, report
    assert peak <= budget_mb * MB * OVER_BUDGET, f"RSS {peak / MB:.1f} MB over --models-mb {budget_mb}\n{report}"
    assert doc["hwm_bytes"] <= budget_mb * MB * OVER_BUDGET, f"peak RSS {doc['hwm_bytes'] / MB:.1f} MB\n{report}"


def test_release_collects_a_cycle_a_thread_still_held_when_the_unload_began():
    """An unload's first collection may run while the thread that closed the service still holds it; release
    collects again until what held the model's memory is gone (a bounded poll), then says whether it is."""
    import threading

    class Model:  # a model and its engine in a reference cycle, as a closed scheduler leaves them
        def __init__(self):
            self.engine = {"model": self}

    model = Model()
    held = [w for w in holders(_Backend(model))]
    go = threading.Event()
    holder = threading.Thread(target=lambda m=model: go.wait(10) and m is not None)  # keeps it until go is set
    holder.start()
    del model
    threading.Timer(0.1, go.set).start()
    assert release(held, wait_s=10)
    holder.join(10)
    assert held[0]() is None

    stuck = Model()
    assert not release(holders(_Backend(stuck)), wait_s=0.05)  # still referenced: said, not waited for forever


class _Backend:
    def __init__(self, model):
        self.model = model

    def holders(self) -> list:
        return [self.model]
