"""EXP-019's switching phase: two models under a ``--models-mb`` that holds only one, so that every turn
after the first unloads one model and loads the other.

One agent per model; their turns alternate (main, small, main, ...). Each step goes to three sides in an
order that rotates step by step:

* ``ours``: the fleet server (both models unpinned, so the first request loads; the first turn on a model
  after the other was loaded is a *switch*: ``switch_first`` for an agent's first turn, ``switch_back``
  for its next turn, whose cache comes back from disk);
* ``single``: a server of that model alone, started before the step (its load done, not timed) and
  SIGTERMed after it: the same turn as its first after a start, its cache from its own disk; on a
  ``switch_back`` step, then the same messages under a fresh cache salt (a fresh prefill);
* ``mlx_lm``: ``mlx_lm.server`` sent the model's directory as ``model``: it loads it in place of the
  one it held, and its prompt caches (in RAM, keyed by model) may still hold the agent's last turn.

``ours`` and ``single`` are sent the same messages (ours' history); ``mlx_lm`` keeps its own (its own
greedy replies). Before the fleet server's first request its RSS is sampled with no model loaded: the
overhead the memory verdict allows above ``--models-mb``.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from harness.servers.client import client
from harness.servers.ours import get_json
from harness.servers.phases import QUESTIONS
from harness.servers.processes import tree_rss
from harness.trials.multi_model.client import stream_turn
from harness.trials.multi_model.sampler import MemorySampler
from harness.trials.multi_model.servers import FleetServer, model_states, single_server, start_mlx_lm

SIDES = ("ours", "single", "mlx_lm")
_LOAD_S = re.compile(r'^semantic_model_load_seconds\{model="([^"]+)"\}\s+(\S+)', re.M)


def step_plan(model_ids: list[str], rounds: int) -> list[dict]:
    """Each step's model, round and kind: models alternate, so every step after the first is a switch."""
    n = len(model_ids)
    return [{"step": k, "model": model_ids[k % n], "round": k // n + 1,
             "kind": "first" if k == 0 else "switch_first" if k < n else "switch_back"} for k in range(rounds * n)]


def question(model_id: str, round_: int) -> dict:
    return {"role": "user", "content": f"{QUESTIONS[round_ % len(QUESTIONS)]} (agent on {model_id}, turn {round_})"}


def load_seconds(url: str) -> dict[str, float]:
    """Each model's last load time from ``/metrics`` (``semantic_model_load_seconds``)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    return {m: float(v) for m, v in _LOAD_S.findall(text)}


class Switching:
    """The servers of the phase and each side's conversations; :meth:`run` takes the steps."""

    def __init__(self, p: dict, models: dict[str, Path], systems: dict[str, dict], work: Path):
        self.p, self.models, self.systems, self.work = p, models, systems, work
        mb = p["switch_models_mb"]
        self.fleet = FleetServer(models, work / "fleet-cache", work / "fleet.log",
                                 ["--models-mb", str(mb), "--pool-mb", str(p["pool_mb"]), *p["server_args"]])
        self.single_args = ["--pool-mb", str(p["pool_mb"]), *p["server_args"]]
        self.peer = None
        self.sampler: MemorySampler | None = None
        self.history: dict[str, dict[str, list[dict]]] = {"ours": {}, "mlx_lm": {}}
        # side -> agent -> its last (prompt, completion) tokens there
        self.last: dict[str, dict[str, tuple[int, int]]] = {"ours": {}, "mlx_lm": {}}
        self.steps: list[dict] = []

    def start(self) -> dict:
        """mlx_lm.server first (its load then weighs on nothing measured), then the fleet server, sampled idle."""
        if "mlx_lm.server" in self.p["peers"]:
            self.peer = start_mlx_lm(self.models[next(iter(self.models))], self.work, self.p["ready_timeout_s"])
        self.fleet.start()
        self.sampler = MemorySampler(lambda: self.fleet.pid, self.fleet.url, self.p["sample_s"], "idle").start()
        self.sampler.wait_samples(self.p["idle_samples"])
        stats = get_json(self.fleet.url, "/v1/cache/stats") or {}
        idle = {"states": model_states(self.fleet.url), "fleet": stats.get("fleet")}
        self.sampler.phase = "switch"
        return idle

    def stop(self) -> None:
        if self.sampler:
            self.sampler.stop()
        self.fleet.stop(signal.SIGTERM)
        self.fleet.kill_now()
        if self.peer is not None:
            self.peer.stop()

    def run(self) -> list[dict]:
        ids = list(self.models)
        for plan in step_plan(ids, self.p["switch_rounds"]):
            self.steps.append(self._step(plan))
        return self.steps

    def _step(self, plan: dict) -> dict:
        mid, rnd, k = plan["model"], plan["round"], plan["step"]
        agent, q = f"agent-{mid}", question(mid, rnd)
        ours_msgs = self.history["ours"].get(agent, [self.systems[mid]]) + [q]
        peer_msgs = self.history["mlx_lm"].get(agent, [self.systems[mid]]) + [q]
        step = {**plan, "agent": agent, "state_before": model_states(self.fleet.url).get(mid)}
        # what a turn resumed whole must find cached: its previous prompt and reply (the reply's last token
        # may be unfed: ``reply_slack``)
        for side in ("ours", "mlx_lm"):
            prev = self.last[side].get(agent)
            step[f"{side}_expected_cached"] = prev[0] + prev[1] - self.p["reply_slack"] if prev else None
        order = [s for s in SIDES if s != "mlx_lm" or self.peer is not None]
        order = order[k % len(order):] + order[:k % len(order)]
        for side in order:
            if side == "ours":
                step["ours"] = stream_turn(client(self.fleet.url, self.p["request_timeout_s"]), mid, ours_msgs,
                                           self.p["max_tokens"], agent).row()
                step["load_s"] = load_seconds(self.fleet.url).get(mid)
            elif side == "mlx_lm":
                step["mlx_lm"] = stream_turn(client(self.peer.url, self.p["request_timeout_s"]), str(self.models[mid]),
                                             peer_msgs, self.p["max_tokens"]).row()
            else:
                step.update(self._single(mid, agent, ours_msgs, fresh=plan["kind"] == "switch_back"))
        self._keep(step, agent, ours_msgs, peer_msgs)
        # where memory stands once the step is done: what the fleet counts, and the process's RSS
        fleet = (get_json(self.fleet.url, "/v1/cache/stats") or {}).get("fleet") or {}
        step["fleet_resident_mb"] = (fleet.get("resident_bytes") or 0) / 2**20 if fleet else None
        step["rss_after_mb"] = tree_rss(self.fleet.pid) / 2**20 if self.fleet.pid else None
        return step

    def _single(self, mid: str, agent: str, messages: list[dict], fresh: bool) -> dict:
        """The same turn as the first of a server of ``mid`` alone, then (``fresh``) the same messages
        under a fresh cache salt; the server is SIGTERMed after (its saves are written first)."""
        srv = single_server(mid, self.models[mid], self.work, self.single_args)
        out: dict = {"single_start_s": srv.start()}
        try:
            cl = client(srv.url, self.p["request_timeout_s"])
            out["single"] = stream_turn(cl, mid, messages, self.p["max_tokens"], agent).row()
            if fresh:
                out["fresh"] = stream_turn(cl, mid, messages, self.p["max_tokens"], fresh=True).row()
        finally:
            srv.stop(signal.SIGTERM)
            srv.kill_now()
        return out

    def _keep(self, step: dict, agent: str, ours_msgs: list[dict], peer_msgs: list[dict]) -> None:
        for side, msgs in (("ours", ours_msgs), ("mlx_lm", peer_msgs)):
            row = step.get(side)
            if row is not None and row["error"] is None:
                self.history[side][agent] = msgs + [{"role": "assistant", "content": row["text"]}]
                self.last[side][agent] = (row["prompt_tokens"], row["completion_tokens"])


def run_switching(p: dict, models: dict[str, Path], systems: dict[str, dict], work: Path) -> dict:
    """The phase, its servers stopped at its end whatever happens; returns its steps and samples (and
    ``error`` where it stopped early)."""
    work.mkdir(parents=True, exist_ok=True)
    sw = Switching(p, models, systems, work)
    out: dict = {"models_mb": p["switch_models_mb"], "pool_mb": p["pool_mb"], "steps": sw.steps}
    try:
        out["idle"] = sw.start()
        sw.run()
    except Exception as exc:  # recorded (a P0 fails); the steps taken so far are kept
        out["error"] = f"{exc!r}\n--- fleet server log ---\n{sw.fleet.log_tail(3000)}"
    finally:
        sw.stop()
        if sw.sampler:
            out["rss"], out["fleet"] = sw.sampler.rss, sw.sampler.fleet
    return out
