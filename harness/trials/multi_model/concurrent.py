"""EXP-019's concurrent phase: both models loaded in one server against two servers of one model each.

Two configurations on the same cores, measured alternately (never at once), the order swapped every round:

* ``fleet``: one ``semantic serve`` with both models pinned (loaded at start) and a ``--models-mb`` that
  holds both;
* ``singles``: two servers of one model each, running side by side.

Each round, every agent (``conc_agents`` per model, each model's agents on that model's shared system
prompt) sends its next turn at the same moment (a barrier); per model, the median client TTFT of the
round on one configuration over the other's is the round's ratio. Before each configuration's round every
server has written its saves, so no save of the other configuration's round runs beside it.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.servers.client import client
from harness.trials.multi_model.client import stream_turn
from harness.trials.multi_model.sampler import MemorySampler
from harness.trials.multi_model.servers import FleetServer, single_server, wait_saved
from harness.trials.multi_model.switching import question

CONFIGS = ("fleet", "singles")


def round_order(round_: int) -> tuple[str, ...]:
    """The configurations' order in a round: swapped every round, so drift weighs on both alike."""
    return CONFIGS if round_ % 2 else CONFIGS[::-1]


class Concurrent:
    """The phase's servers (all started before the first round) and each configuration's conversations."""

    def __init__(self, p: dict, models: dict[str, Path], systems: dict[str, dict], work: Path):
        self.p, self.models, self.systems = p, models, systems
        base = ["--pool-mb", str(p["pool_mb"]), *p["server_args"]]
        pins = [a for mid in models for a in ("--pin", mid)]
        self.fleet = FleetServer(models, work / "fleet-cache", work / "fleet.log",
                                 ["--models-mb", str(p["conc_models_mb"]), *pins, *base])
        self.singles = {mid: single_server(mid, d, work, base) for mid, d in models.items()}
        self.samplers: dict[str, MemorySampler] = {}
        self.history: dict[str, dict[str, list[dict]]] = {c: {} for c in CONFIGS}
        self.rows: list[dict] = []

    def start(self) -> None:
        for name, srv in (("fleet", self.fleet), *self.singles.items()):
            srv.start()   # one after the other: their loads do not contend
            # the singles are sampled alike, so the stats requests weigh on both configurations the same
            self.samplers[name] = MemorySampler((lambda s=srv: s.pid), srv.url, self.p["sample_s"],
                                                "concurrent").start()

    def stop(self) -> None:
        for s in self.samplers.values():
            s.stop()
        for srv in (self.fleet, *self.singles.values()):
            srv.stop(signal.SIGTERM)
            srv.kill_now()

    def url_of(self, config: str, mid: str) -> str:
        return self.fleet.url if config == "fleet" else self.singles[mid].url

    def settle(self) -> int:
        """Wait until no server has a save pending; returns what was still pending at the deadline."""
        return (wait_saved(self.fleet.url, list(self.models), self.p["settle_max_s"])
                + sum(wait_saved(s.url, [mid], self.p["settle_max_s"]) for mid, s in self.singles.items()))

    def run(self) -> list[dict]:
        for rnd in range(1, self.p["conc_rounds"] + 1):
            for config in round_order(rnd):
                pending = self.settle()
                self.rows += self._round(config, rnd, pending)
        return self.rows

    def _round(self, config: str, rnd: int, pending: int) -> list[dict]:
        agents = [(mid, f"conc-{mid}-{i}") for mid in self.models for i in range(self.p["conc_agents"])]
        gate = threading.Barrier(len(agents))
        clients = {mid: client(self.url_of(config, mid), self.p["request_timeout_s"]) for mid in self.models}
        hist = self.history[config]

        def one(mid: str, agent: str) -> dict:
            msgs = hist.get(agent, [self.systems[mid]]) + [question(mid, rnd)]
            gate.wait(60)   # every agent sends at the same moment
            row = stream_turn(clients[mid], mid, msgs, self.p["max_tokens"], agent).row(
                config=config, model=mid, agent=agent, round=rnd, pending_before=pending)
            if row["error"] is None:
                hist[agent] = msgs + [{"role": "assistant", "content": row["text"]}]
            return row

        with ThreadPoolExecutor(len(agents)) as pool:
            return list(pool.map(lambda a: one(*a), agents))


def run_concurrent(p: dict, models: dict[str, Path], systems: dict[str, dict], work: Path) -> dict:
    """The phase, its servers stopped at its end whatever happens; returns its rows and the fleet server's
    samples (and ``error`` where it stopped early)."""
    work.mkdir(parents=True, exist_ok=True)
    c = Concurrent(p, models, systems, work)
    out: dict = {"models_mb": p["conc_models_mb"], "pool_mb": p["pool_mb"], "rows": c.rows}
    try:
        c.start()
        c.run()
    except Exception as exc:  # recorded (a P0 fails); the rounds taken so far are kept
        out["error"] = f"{exc!r}\n--- fleet server log ---\n{c.fleet.log_tail(3000)}"
    finally:
        c.stop()
        fleet = c.samplers.get("fleet")
        out["rss"], out["fleet"] = (fleet.rss, fleet.fleet) if fleet else ([], [])
        out["singles_rss_peak_bytes"] = {k: max((r["rss_bytes"] for r in s.rss), default=None)
                                         for k, s in c.samplers.items() if k != "fleet"}
    return out
