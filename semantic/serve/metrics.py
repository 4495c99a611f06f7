"""Prometheus metrics: what each request cost and what the cache did, plus the backend's state.

Each app has its own :class:`CollectorRegistry` (several apps in one test
process never collide). Request counters and histograms are updated as
requests run; the cache, pool and queue gauges are read from
``backend.stats()`` of every loaded model at scrape time by :class:`FleetCollector`,
each series labelled with its ``model``.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from semantic.service import SAVE_FAILURES

log = logging.getLogger("semantic.serve")

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes
API_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/models": "models",
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
GAP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def api_label(path: str) -> str:
    """A bounded label: unknown paths share one, so scanners cannot grow the series."""
    return API_PATHS.get(path, "other")


class ServeMetrics:
    """The counters and histograms the routes update."""

    def __init__(self, fleet):
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("semantic_requests", "HTTP requests by API and status", ["api", "status"], registry=r)
        per_model = ["api", "model"]
        self.prompt_tokens = Counter("semantic_prompt_tokens", "Prompt tokens, cached ones included", per_model,
                                     registry=r)
        self.cached_tokens = Counter("semantic_cached_tokens", "Prompt tokens served from a cache", per_model,
                                     registry=r)
        self.completion_tokens = Counter("semantic_completion_tokens", "Generated tokens", per_model, registry=r)
        self.ttft = Histogram("semantic_ttft_seconds", "Submit to first token, queueing included (server side)",
                              per_model, buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("semantic_inter_token_seconds", "Time between streamed deltas",
                                     per_model, buckets=GAP_BUCKETS, registry=r)
        self.request_seconds = Histogram("semantic_request_seconds", "Whole request, streams to their end",
                                         ["api"], buckets=LATENCY_BUCKETS, registry=r)
        self.turn_saves = Counter("semantic_turn_cache_saves", "Named agents' turns by what their reply said of "
                                  "the cache save: saved, pending (behind the reply) or failed",
                                  ["api", "model", "result"], registry=r)
        r.register(FleetCollector(fleet))

    def observe_final(self, api: str, model: str, final) -> None:
        """Count one finished turn (a :class:`~semantic.serve.turn.backend.Final`) of ``model``."""
        self.prompt_tokens.labels(api, model).inc(final.prompt_tokens)
        self.cached_tokens.labels(api, model).inc(final.cached_tokens)
        self.completion_tokens.labels(api, model).inc(final.completion_tokens)
        self.ttft.labels(api, model).observe(final.ttft_s)
        if final.cache_save is not None:
            self.turn_saves.labels(api, model, final.cache_save).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FleetCollector:
    """Gauges read from every loaded model's ``backend.stats()`` at each scrape, labelled ``model``, and the
    models' own: loaded or not, their memory, loads and unloads."""

    def __init__(self, fleet):
        self.fleet = fleet

    def describe(self):
        return []  # no names at registration: collect() would call stats() on a backend still starting

    def collect(self):
        merged: dict[str, Metric] = {}
        for model_id, backend in self.fleet.loaded():
            try:
                s = backend.stats()
            except Exception:  # a scrape must not fail the whole exposition
                log.exception("stats() of %s failed during a scrape", model_id)
                continue
            for part in STATS_PARTS:
                for family in part(s):
                    _merge(merged, family, model_id)
        yield from merged.values()
        yield from _fleet_metrics(self.fleet)


def _merge(merged: dict, family, model_id: str) -> None:
    """``family``'s samples into one family of its name across models, each with a ``model`` label."""
    out = merged.get(family.name)
    if out is None:
        out = merged[family.name] = Metric(family.name, family.documentation, family.type)
    for sample in family.samples:
        out.add_sample(sample.name, {"model": model_id, **sample.labels}, sample.value)


def _fleet_metrics(fleet):
    """Each served model's state and memory, and the loads and unloads that changed them."""
    rows = fleet.rows()
    loaded = GaugeMetricFamily("semantic_model_loaded", "1 while the model is loaded", labels=["model"])
    memory = GaugeMetricFamily("semantic_model_memory_bytes", "The model's weights, KV pool and working memory "
                               "while loaded (estimated before its load)", labels=["model"])
    loads = CounterMetricFamily("semantic_model_loads", "Times the model was loaded", labels=["model"])
    unloads = CounterMetricFamily("semantic_model_unloads", "Times the model was unloaded, by reason (lru: room "
                                  "for another under --models-mb; idle: its TTL; shutdown)", labels=["model", "reason"])
    seconds = GaugeMetricFamily("semantic_model_load_seconds", "The model's last load time", labels=["model"])
    for r in rows:
        loaded.add_metric([r["id"]], float(r["state"] == "loaded"))
        memory.add_metric([r["id"]], float(r["memory_bytes"]))
        loads.add_metric([r["id"]], float(r["loads"]))
        for reason in ("lru", "idle", "shutdown"):
            unloads.add_metric([r["id"], reason], float(r["unloads"].get(reason, 0)))
        if r["load_s"] is not None:
            seconds.add_metric([r["id"]], float(r["load_s"]))
    yield from (loaded, memory, loads, unloads, seconds)
    budget = fleet.summary()["budget_bytes"]
    if budget is not None:
        yield GaugeMetricFamily("semantic_models_budget_bytes", "--models-mb: the server's resident memory "
                                "(runtime, kept tokenizers, loaded models)", value=float(budget))
        yield GaugeMetricFamily("semantic_models_overhead_bytes", "What no unload gives back: the runtime and "
                                "the tokenizers loads kept", value=float(fleet.overhead_bytes))


def _state_gauges(s: dict):
    """One gauge each for the backend's state now: requests, the pool, resident caches, disk, saves."""
    gauges = {
        "queue_depth": ("Requests waiting to start", s["requests"]["queued"]),
        "in_flight": ("Requests generating now", s["requests"]["in_flight"]),
        "pool_used_bytes": ("KV block pool bytes in use", s["pool"]["used_bytes"]),
        "pool_capacity_bytes": ("KV block pool capacity", s["pool"]["capacity_bytes"]),
        "pool_used_blocks": ("KV blocks in use", s["pool"]["used_blocks"]),
        "pool_cached_blocks": ("KV blocks holding reusable prefixes", s["pool"]["cached_blocks"]),
        "ram_bytes": ("Agent caches resident in RAM (distinct pool blocks)", s["ram"]["bytes"]),
        "ram_budget_bytes": ("RAM budget for resident agent caches (0: none)", s["ram"]["budget_bytes"] or 0),
        "ram_peak_bytes": ("Most resident bytes after any scheduler step", s["ram"]["peak_bytes"]),
        "ram_agents": ("Agents resident in RAM", s["ram"]["agents"]),
        "disk_bytes": ("Agent cache files on disk", s["disk"]["bytes"]),
        "disk_budget_bytes": ("Disk budget for agent caches", s["disk"]["budget_bytes"]),
        "disk_agents": ("Agents saved on disk", s["disk"]["agents"]),
        "disk_shared_bytes": ("Block files on disk that two agents or more use", s["disk"]["shared_bytes"]),
        "disk_unique_bytes": ("Cache bytes on disk that one agent alone uses", s["disk"]["unique_bytes"]),
        "quarantined_files": ("Damaged cache files set aside", s["quarantined"]),
        "cached_token_ratio": ("Prompt tokens served from a cache / all prompt tokens", s["tokens"]["hit_rate"]),
        "saves_pending": ("Cache saves not yet on disk", s["saves"]["pending"]),
    }
    for name, (doc, value) in gauges.items():
        yield GaugeMetricFamily(f"semantic_{name}", doc, value=float(value))


def _eviction_counters(s: dict):
    """Caches evicted from RAM, how the RAM budget held, and the bytes saves wrote."""
    yield CounterMetricFamily("semantic_disk_written_bytes", "Bytes cache saves wrote to disk",
                              value=float(s["disk"]["written_bytes"]))
    yield CounterMetricFamily("semantic_evictions", "Agent caches evicted from RAM", value=float(s["evictions"]))
    yield CounterMetricFamily("semantic_ram_budget_evictions", "Saved agent caches evicted to hold the RAM budget",
                              value=float(s["ram"]["budget_evictions"]))
    yield CounterMetricFamily("semantic_ram_over_budget_steps", "Scheduler steps that ended over the RAM budget",
                              value=float(s["ram"]["over_budget_steps"]))


def _save_counters(s: dict):
    """Saves that failed (by cause), were skipped while backing off, or whose caches were dropped unsaved."""
    saves = s["saves"]
    yield CounterMetricFamily("semantic_save_errors", "Cache saves that failed", value=float(saves["errors"]))
    by_kind = CounterMetricFamily("semantic_save_errors_by_kind", "Cache saves that failed, tried or skipped, by "
                                  "cause", labels=["kind"])
    for kind in SAVE_FAILURES:
        by_kind.add_metric([kind], float(saves.get("errors_by_kind", {}).get(kind, 0)))
    yield by_kind
    yield from _counters(saves, (("skipped", "save_skipped", "Cache saves not tried while backing off after a failure"),
                                 ("lost", "cache_lost", "Unsaved agent caches dropped from RAM to hold its bounds")))


def _disk_gauges(s: dict):
    """The cache directory's state now, its free bytes and the budget it leaves (when known)."""
    disk = s["disk"]
    state = GaugeMetricFamily("semantic_disk_state", "1 for the cache directory's state now (ok, or why saves "
                              "fail)", labels=["state"])
    for name in ("ok", *SAVE_FAILURES):
        state.add_metric([name], float(disk.get("state", "ok") == name))
    yield state
    for name, doc in (("free_bytes", "Free bytes on the cache directory's filesystem"),
                      ("effective_budget_bytes", "Disk budget now: --disk-mb, or less when the disk holds less")):
        if disk.get(name) is not None:
            yield GaugeMetricFamily(f"semantic_disk_{name}", doc, value=float(disk[name]))


def _echo_counters(s: dict):
    """Echoed replies taken as the agent's generated ids, or rendered again."""
    yield from _counters(s.get("echo", {}), (
        ("spliced", "echo_spliced", "Prompts whose echoed reply was the agent's generated ids"),
        ("rendered", "echo_rendered", "Prompts of known agents whose echoed reply was rendered again")))


def _remote_metrics(s: dict):
    """The tier shared with other servers (--remote): its counters, call latency and whether it answers;
    nothing without one."""
    remote = s.get("remote")
    if not remote:
        return
    yield from _counters(remote, tuple((key, f"remote_{key}", doc) for key, doc in (
        ("hits", "Agent caches fetched from the shared tier"),
        ("misses", "Shared-tier lookups that found nothing"),
        ("bytes_in", "Bytes fetched from the shared tier"),
        ("bytes_out", "Bytes published to the shared tier"),
        ("verify_failures", "Shared-tier values refused by the cache-file checks and dropped"),
        ("errors", "Shared-tier calls that failed (down, slow, refused)"),
        ("skipped", "Shared-tier calls skipped while backing off"),
        ("evicted", "Agent caches our remote budget deleted from the shared tier"))))
    lat = GaugeMetricFamily("semantic_remote_mean_latency_seconds",
                            "Mean time of a shared-tier call that answered, by call", labels=["call"])
    for call, ms in sorted(remote.get("mean_latency_ms", {}).items()):
        lat.add_metric([call], ms / 1000)
    yield lat
    yield GaugeMetricFamily("semantic_remote_up", "1 while the shared tier answers", value=float(remote["up"]))


def _speculation_counters(s: dict):
    """Prompt-lookup drafts: tokens drafted, and those the model accepted."""
    yield from _counters(s.get("speculation", {}), (
        ("drafted", "spec_drafted_tokens", "Tokens drafted from the context for verification"),
        ("accepted", "spec_accepted_tokens", "Drafted tokens the model agreed with (decode steps saved)")))


def _counters(values: dict, table: tuple[tuple[str, str, str], ...]):
    """One counter per ``(key, name, help)`` of ``table``: ``semantic_<name>``, ``values[key]`` (0 when absent)."""
    for key, name, doc in table:
        yield CounterMetricFamily(f"semantic_{name}", doc, value=float(values.get(key, 0)))


# in exposition order: each reads its part of ``backend.stats()``
STATS_PARTS = (_state_gauges, _eviction_counters, _save_counters, _disk_gauges, _echo_counters, _remote_metrics,
               _speculation_counters)


class MetricsMiddleware:
    """ASGI middleware: counts every request by API and status and times it (streams to their end)."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, t0 = "499", time.perf_counter()  # 499: the client left before any answer

        async def tracking(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception:
            status = "500" if status == "499" else status
            raise
        finally:
            api = api_label(scope.get("path", ""))
            self.metrics.requests.labels(api, status).inc()
            self.metrics.request_seconds.labels(api).observe(time.perf_counter() - t0)
