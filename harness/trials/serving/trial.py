"""EXP-009: our server side by side with the servers users would pick instead, over one HTTP workload.

Every runnable target (``harness.servers.targets``: ours, ``mlx_lm.server``,
mlx-vlm's APC, vllm-mlx) loads the same model directory with the same BLAS
and greedy decoding, and the phases of ``harness.servers.phases`` send each
step to all of them in rotating order. Targets that cannot run here (oMLX,
LM Studio, llama.cpp) keep their row with the reason. Peers' venvs are
built on demand under ``.peers/`` (git-ignored); the results record every
version, flag and the BLAS each server process mapped.

``harness.trials.serving.report`` turns the requests' records into metrics, checks
and plots: ratios are ours over the best peer's (lower is better for TTFT and
RSS), from medians of the same run.
"""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

from harness.servers import phases as P
from harness.servers import venvs
from harness.servers.loadgen import chat, chat_counter
from harness.servers.targets import MLX_LM, OURS, TARGETS, ServingError
from harness.trials.base import TrialKind, Param, register
from harness.trials.serving.report import record

ALL_PHASES = ("warm", "five_turns", "agents", "shared", "restart", "concurrency", "matched")


def _matched(pool_mb: int) -> dict[str, dict]:
    """Every cache budget set to our pool's bytes (entries unbounded where a server counts entries)."""
    return {
        OURS: {"pool_mb": pool_mb},
        "mlx_lm.server": {"prompt_cache_size": 1000, "prompt_cache_bytes": pool_mb << 20},
        "mlx-vlm": {"apc_memory_max_gb": pool_mb / 1024},
        "vllm-mlx": {"cache_memory_mb": pool_mb},
    }


def five_turn_prompts(tokenizer, repeat: int, system_tokens: int, question_tokens: int) -> tuple[dict, list[dict]]:
    """One five-turn conversation's system prompt and 4 user messages.

    Each repeat's system prompt differs from its first words on, so its first turn is cold on every
    server (only the chat template's opening tokens are shared)."""
    from harness.prompts import text_of_tokens

    head = f"Ship's log {repeat + 1}. You are a careful research agent. Reference material:"
    system = {"role": "system", "content": text_of_tokens(tokenizer, system_tokens, 500 + 211 * repeat, head)}
    questions = [{"role": "user", "content": text_of_tokens(tokenizer, question_tokens, 40 * j + 7 * repeat,
                                                            f"Question {j}:")} for j in range(1, 5)]
    return system, questions


def run(ctx) -> None:
    from mlx_lm.utils import load_tokenizer

    from harness import models

    p, res = ctx.params, ctx.results
    variant = models.default_variant(ctx.config.model_variant)
    model_dir = p["model_dir"] or models.prepare(ctx.model_name, variant=variant)
    phases = p["phases_by_model"].get(ctx.model_name, p["phases"])
    wanted = [TARGETS[n] for n in p["targets"]]
    runnable, skipped, versions, pythons = _install(wanted)
    res.output("targets", {"run": [t.name for t in runnable], "not_run": skipped, "versions": versions,
                           "notes": {t.name: t.notes for t in wanted}})
    if OURS not in [t.name for t in runnable]:
        raise RuntimeError(f"our server cannot run here: {skipped.get(OURS)}")

    tokenizer = load_tokenizer(Path(model_dir))
    bench = _bench(ctx, Path(model_dir), tokenizer, pythons)
    out: dict = {"phases": phases, "settings": {}}
    ctx.progress.total = len(phases)
    try:
        _run_phases(ctx, bench, tokenizer, runnable, out)
    finally:
        bench.stop_all()
    out["events"] = bench.events
    record(ctx, bench, out, [t.name for t in runnable])


def _install(wanted: list) -> tuple[list, dict, dict, dict]:
    """The targets that can run here, each with its venv built: (runnable, name -> why not, name -> package
    versions, name -> a peer venv's python)."""
    runnable, skipped, versions, pythons = [], {}, {}, {}
    for t in wanted:
        if not t.runnable_here:
            skipped[t.name] = t.reason
            continue
        try:
            venv = venvs.ensure_venv(t) if t.venv else None
        except ServingError as exc:
            skipped[t.name] = f"install failed: {exc}"[:500]
            continue
        if venv is None:  # this interpreter (.venv)
            venv = venvs.Venv(Path(sys.executable), venvs.installed_versions(sys.executable), None, False)
        else:
            pythons[t.name] = venv.python
        versions[t.name] = venv.pick(t.packages)
        runnable.append(t)
    return runnable, skipped, versions, pythons


def _bench(ctx, model_dir: Path, tokenizer, pythons: dict) -> P.Bench:
    """The workload's bench: every server loads ``model_dir``; users share one system prompt."""
    from harness.prompts import system_prompt

    p = ctx.params
    system = system_prompt(tokenizer, p["system_tokens"])
    work = Path(tempfile.mkdtemp(prefix="exp009-"))
    return P.Bench(model_dir, ctx.model_name, work, chat_counter(tokenizer),
                   lambda text: len(tokenizer.encode(text, add_special_tokens=False)), system,
                   p["answer_tokens"], pythons)


def _run_phases(ctx, bench: P.Bench, tokenizer, runnable: list, out: dict) -> None:
    """The configured phases in their fixed order, one progress step each; ``out`` gathers what they return."""
    p, phases = ctx.params, out["phases"]
    defaults = {t.name: {} for t in runnable}
    out["settings"]["defaults"] = {t.name: t.settings() for t in runnable}
    bench.start_all(runnable, defaults, "defaults")
    if "warm" in phases:
        bench.warm(p["warm_rounds"])
        ctx.progress.update(1)
    if "five_turns" in phases:
        out["five_turns"] = _five_turns_phase(bench, tokenizer, p, {t.name for t in runnable})
        ctx.progress.update(1)
    if "agents" in phases or "restart" in phases:
        bench.agents("agents", range(p["agents"]), p["agent_rounds"])
        ctx.progress.update(1)
    if "shared" in phases:
        out["rss"] = bench.shared(range(100, 100 + p["shared_users"]))
        ctx.progress.update(1)
    if "restart" in phases:
        _restart_phase(bench, p)
        ctx.progress.update(1)
    if "concurrency" in phases:
        out["concurrency"] = {level: bench.concurrency(level, p["concurrency_rounds"], 1000 + 100 * i)
                              for i, level in enumerate(p["concurrency"])}
        ctx.progress.update(1)
    out["rss_end"] = bench.rss()
    bench.stop_all()
    if "matched" in phases:
        _matched_phase(bench, p, runnable, out)
        ctx.progress.update(1)


def _five_turns_phase(bench: P.Bench, tokenizer, p: dict, runnable: set[str]) -> list[dict]:
    """Every repeat's five-turn conversation, on the configured targets that run here."""
    names = set(p["five_turns_targets"]) & runnable
    rows = []
    for i in range(p["five_turns_repeats"]):
        system5, questions = five_turn_prompts(tokenizer, i, p["five_turns_system_tokens"],
                                               p["five_turns_question_tokens"])
        rows += bench.five_turns(2000 + i, system5, questions, p["five_turns_answer_tokens"], names, fresh=OURS)
    return rows


def _restart_phase(bench: P.Bench, p: dict) -> None:
    """The agents' next round after a SIGTERM restart, then after a SIGKILL one."""
    who = range(min(p["restart_users"], p["agents"]))
    bench.restart_all(signal.SIGTERM, "defaults", p["kill_after_s"])
    bench.agents("restart-sigterm", who, 1, first_round=p["agent_rounds"] + 1)
    bench.restart_all(signal.SIGKILL, "defaults", p["kill_after_s"])
    bench.agents("restart-sigkill", who, 1, first_round=p["agent_rounds"] + 2)


def _matched_phase(bench: P.Bench, p: dict, runnable: list, out: dict) -> None:
    """The agents again, every server restarted with its cache budget matched to our pool's bytes."""
    settings = {n: s for n, s in _matched(p["matched_pool_mb"]).items() if n in [t.name for t in runnable]}
    out["settings"]["matched"] = {t.name: t.settings(**settings.get(t.name, {})) for t in runnable}
    bench.start_all(runnable, settings, "matched")
    bench.agents("agents-matched", range(p["agents"]), p["agent_rounds"])
    bench.stop_all()


def _validate(p: dict) -> None:
    unknown = [n for n in p["targets"] if n not in TARGETS]
    if unknown or OURS not in p["targets"]:
        raise ValueError(f"targets must include {OURS!r} and name known targets ({sorted(TARGETS)}), not {unknown}")
    for ph in [*p["phases"], *(x for v in p["phases_by_model"].values() for x in v)]:
        if ph not in ALL_PHASES:
            raise ValueError(f"unknown phase {ph!r}; phases: {ALL_PHASES}")
    if OURS not in p["five_turns_targets"]:
        raise ValueError(f"five_turns_targets must include {OURS!r} (its replies are checked)")


KIND = register(TrialKind(
    name="serving",
    run=run,
    params={
        "targets": Param(list, [OURS, "mlx_lm.server", "mlx-vlm", "vllm-mlx", "omlx", "lmstudio-mlx-engine", "llama.cpp"],
                         "servers to compare (harness.servers.targets); those not runnable here keep a row"),
        "phases": Param(list, list(ALL_PHASES), f"phases to run, of {ALL_PHASES}"),
        "phases_by_model": Param(dict, {}, "model -> phases, overriding `phases` for that model"),
        "system_tokens": Param(int, 600, "tokens of the system prompt every user shares"),
        "answer_tokens": Param(int, 32, "max_tokens of every reply (greedy)"),
        "warm_rounds": Param(int, 4, "rounds of the warm phase's user (each: append, regenerate, edit)", min=2),
        "five_turns_targets": Param(list, [OURS, MLX_LM],
                                    "servers the five_turns phase asks (its goal compares ours with mlx_lm.server)"),
        "five_turns_repeats": Param(int, 3,
                                    "five-turn conversations, each with its own system prompt (medians over them)",
                                    min=1),
        "five_turns_system_tokens": Param(int, 560,
                                          "the five turns' system prompt (with the question: past a 512-token window)"),
        "five_turns_question_tokens": Param(int, 10, "tokens of each user message of the five turns"),
        "five_turns_answer_tokens": Param(int, 8, "max_tokens of each five-turn reply (greedy)"),
        "agents": Param(int, 16, "users in round robin (mlx_lm.server keeps 10 caches by default)", min=1),
        "agent_rounds": Param(int, 2, "rounds per user in the agents phase (round 1 has no cache of its own)", min=2),
        "shared_users": Param(int, 6, "new users whose first turn shares the system prompt (RSS growth)"),
        "restart_users": Param(int, 16, "users whose next round follows each restart"),
        "kill_after_s": Param(float, 2.0, "idle seconds between the last round and the signal"),
        "concurrency": Param(list, [1, 4, 8], "concurrent clients per level"),
        "concurrency_rounds": Param(int, 2, "rounds per concurrent client"),
        "matched_pool_mb": Param(int, 1024, "the cache budget every server gets in the matched pass (our pool)"),
        "model_dir": Param(str, "", "a model directory to serve instead of the prepared one (tests: a tiny model)"),
    },
    plots=frozenset({"ttft_rounds", "ttft_cdf", "throughput", "five_turns"}),
    needs_model=False,
    validate=_validate,
    trial_code=(_run_phases, _five_turns_phase, _restart_phase, _matched_phase,
                P.Bench.warm, P.Bench.five_turns, P.Bench.agents, P.Bench.concurrency, chat),
))
