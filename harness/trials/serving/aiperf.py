"""EXP-009 measured again by a load generator none of us wrote: NVIDIA's AIPerf.

EXP-009's figures come from our own client (``harness.servers.loadgen``). This
module hands the same servers to AIPerf instead: each server is started alone
on 127.0.0.1 (the same model directory, the same OpenBLAS, the same start code
as EXP-009), AIPerf runs one fixed profile per concurrency against it, and
AIPerf's own export (``profile_export_aiperf.json``) is kept and summarized::

    make exp-009-aiperf          # or: python -m harness.trials.serving.aiperf --model smollm2-135m

AIPerf lives in its own venv under ``.peers/aiperf-<version>/`` (a PyPI
install, no torch), built once by :func:`~harness.servers.venvs.ensure_venv`.
It counts tokens with the model directory's own tokenizer, never the hub.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.servers import processes, venvs
from harness.servers.targets import MLX_LM, OURS, ROOT, TARGETS, ServerTarget, ServingError, log_tail

VERSION = "0.13.0"
AIPERF = venvs.ToolRecipe(name="aiperf", venv=f"aiperf-{VERSION}", install=((f"aiperf=={VERSION}",),))
RESULTS = Path("results") / "exp_009_serving" / "aiperf"
DEFAULT_TARGETS = (OURS, MLX_LM, "vllm-mlx")
EXPORT = "profile_export_aiperf.json"
ENDPOINTS = ("chat", "messages")
KEPT = (EXPORT, "profile_export_aiperf.csv", "profile_export.jsonl")   # AIPerf's files copied into results


class AIPerfError(ServingError):
    """AIPerf exited non-zero or wrote no export; the message ends with its log's tail."""


@dataclass(frozen=True, slots=True)
class Profile:
    """One AIPerf run: a synthetic chat workload at one concurrency, stopping after a fixed request count.

    ``input_tokens`` is AIPerf's synthetic user text as AIPerf counts it (bare
    text, no chat template: the server's prompt is longer by the template's
    tokens). ``shared_system_tokens`` > 0 adds one system prompt identical in
    every request, the shape of EXP-009's workload; 0 means every prompt is
    unrelated text, so no server has a prefix to reuse beyond the template's.
    """

    name: str
    input_tokens: int
    output_tokens: int          # max_tokens sent; a greedy reply may stop sooner at EOS
    concurrency: int
    requests: int
    warmup: int = 1
    shared_system_tokens: int = 0
    seed: int = 0
    endpoint: str = "chat"      # AIPerf's endpoint type: chat (/v1/chat/completions) or messages (/v1/messages)

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"{self.name}: endpoint {self.endpoint!r} is not one of {ENDPOINTS}")
        for key in ("input_tokens", "output_tokens", "concurrency", "requests"):
            if getattr(self, key) < 1:
                raise ValueError(f"{self.name}: {key} must be >= 1, not {getattr(self, key)}")
        if self.warmup < 0 or self.shared_system_tokens < 0:
            raise ValueError(f"{self.name}: warmup and shared_system_tokens must be >= 0")

    @property
    def label(self) -> str:
        return f"{self.name}-c{self.concurrency}"


# NOTE: a seed per profile. AIPerf draws the same prompts from the same seed, and every profile runs
# against the same server process: a repeated seed would find the previous profile's prompts cached.
PROFILES: dict[str, tuple[Profile, ...]] = {
    # unrelated prompts: every request is a cold prefill of ~600 tokens
    "random": (Profile("random", 600, 64, 1, 6, seed=1), Profile("random", 600, 64, 4, 8, seed=2)),
    # EXP-009's shape: one 600-token system prompt in every request, a short user turn
    "shared": (Profile("shared", 32, 64, 4, 8, shared_system_tokens=600, seed=3),),
    # the Anthropic API, where a server has one (not mlx_lm.server): not in the default run
    "messages": (Profile("messages", 600, 64, 1, 4, seed=4, endpoint="messages"),),
}


def command(profile: Profile, *, aiperf: Path | str, url: str, model: str, tokenizer: Path | str,
            out_dir: Path | str) -> list[str]:
    """The ``aiperf profile`` command line for ``profile`` against one server.

    Args:
        aiperf: the ``aiperf`` console script of its venv.
        url: the server's base URL (``http://127.0.0.1:PORT``, no ``/v1``).
        model: what requests send as ``model`` (each server names it its own way).
        tokenizer: the model directory the servers load: AIPerf counts tokens with it.
        out_dir: where AIPerf writes its artifacts.
    """
    entries = profile.requests + profile.warmup
    cmd = [str(aiperf), "profile", "--model", model, "--tokenizer", str(tokenizer), "--url", url,
           "--endpoint-type", profile.endpoint, "--streaming",
           "--synthetic-input-tokens-mean", str(profile.input_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(profile.output_tokens), "--output-tokens-stddev", "0",
           "--concurrency", str(profile.concurrency), "--request-count", str(profile.requests),
           "--warmup-request-count", str(profile.warmup),
           # one prompt per request, warmup included: a repeated prompt would be a full cache hit
           "--num-dataset-entries", str(entries), "--random-seed", str(profile.seed),
           "--artifact-dir", str(out_dir), "--ui", "none",
           # no /metrics or GPU to poll here, and every process AIPerf adds competes with the server for 2 cores
           "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1"]
    if profile.endpoint == "chat":
        # max_tokens, not max_completion_tokens: vllm-mlx 0.6.0 ignores the newer field and runs to its own limit
        cmd += ["--use-legacy-max-tokens",
                # greedy like EXP-009; usage in the stream says what each server found cached
                "--extra-inputs", json.dumps({"temperature": 0, "stream_options": {"include_usage": True}})]
    else:
        cmd += ["--extra-inputs", json.dumps({"temperature": 0})]   # the Anthropic stream carries usage itself
    if profile.shared_system_tokens:
        cmd += ["--shared-system-prompt-length", str(profile.shared_system_tokens)]
    return cmd


def aiperf_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """AIPerf's environment: local tokenizer files only, and no request that could leave the machine.

    NOTE: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are removed, not set: AIPerf
    0.13.0's offline path hands a local directory to ``snapshot_download``,
    which rejects it as a repo id. Online, it sees the path is local and loads
    it directly; HF_ENDPOINT points at a closed local port so any hub call
    fails at once instead of reaching out.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONUNBUFFERED="1")
    return env


# --- AIPerf's export, summarized ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Summary:
    """What one AIPerf export says, in seconds and tokens (AIPerf writes milliseconds)."""

    requests: int                       # completed, warmup excluded
    errors: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None             # per request: (latency - TTFT) / (output tokens - 1), then p50
    itl_p99_s: float | None
    chunk_gap_p99_s: float | None       # p99 of every gap between streamed chunks, pooled (EXP-009's itl_p99_s)
    latency_p50_s: float | None         # request latency, send to last chunk
    latency_p99_s: float | None
    output_tok_s: float | None          # all output tokens / the benchmark's duration
    input_tokens_mean: float | None     # as AIPerf counts them: bare text, no chat template
    output_tokens_mean: float | None    # as AIPerf counts them, with the model's tokenizer
    prompt_tokens_mean: float | None    # as the server reported them in usage (template included)
    cached_pct: float | None            # prompt tokens the servers reported cached, % of prompt tokens
    cached_max: float | None            # the most one request found cached: near the prompt means a repeat
    duration_s: float | None


def _stat(export: Mapping, key: str, stat: str, scale: float = 1.0) -> float | None:
    value = (export.get(key) or {}).get(stat)
    return None if value is None else value * scale


def summarize(export: Mapping) -> Summary:
    """The figures the summary table shows, from a parsed ``profile_export_aiperf.json``."""
    ms = 1e-3
    errors = sum(int(e.get("count", 1)) for e in export.get("error_summary") or [])
    return Summary(
        requests=int(_stat(export, "request_count", "avg") or 0),
        errors=errors,
        ttft_p50_s=_stat(export, "time_to_first_token", "p50", ms),
        ttft_p99_s=_stat(export, "time_to_first_token", "p99", ms),
        itl_p50_s=_stat(export, "inter_token_latency", "p50", ms),
        itl_p99_s=_stat(export, "inter_token_latency", "p99", ms),
        chunk_gap_p99_s=_stat(export, "inter_chunk_latency", "p99", ms),
        latency_p50_s=_stat(export, "request_latency", "p50", ms),
        latency_p99_s=_stat(export, "request_latency", "p99", ms),
        output_tok_s=_stat(export, "output_token_throughput", "avg"),
        input_tokens_mean=_stat(export, "input_sequence_length", "avg"),
        output_tokens_mean=_stat(export, "output_sequence_length", "avg"),
        prompt_tokens_mean=_stat(export, "usage_prompt_tokens", "avg"),
        cached_pct=_stat(export, "overall_usage_prompt_cache_read_pct", "avg"),
        cached_max=_stat(export, "usage_prompt_cache_read_tokens", "max"),
        duration_s=_stat(export, "benchmark_duration", "avg"),
    )


@dataclass(slots=True)
class Run:
    """One server under one profile: AIPerf's summary and what the machine was doing meanwhile."""

    server: str
    profile: Profile
    summary: Summary
    load_before: tuple[float, float, float]     # /proc/loadavg: 1, 5, 15 minutes
    load_after: tuple[float, float, float]
    aiperf_cpu_s: float                         # CPU seconds AIPerf's processes spent (user + system)
    wall_s: float
    export_dir: str                             # where its kept files are, relative to the results folder
    blas: str | None = None                     # the OpenBLAS the server had mapped
    # cached / prompt tokens over the measured requests from the server's own log, for a server whose usage
    # has no cached_tokens (vllm-mlx); None where usage says it (AIPerf's cached_pct)
    log_cached_pct: float | None = None
    versions: dict[str, str | None] = field(default_factory=dict)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown_table(runs: Sequence[Run]) -> str:
    """One row per server and profile: AIPerf's percentiles in seconds, with the load beside each."""
    head = ("| profile | server | TTFT p50 / p99 (s) | ITL p50 / p99 (s) | latency p50 / p99 (s) "
            "| output tok/s | out tokens | prompt (server) | cached % | AIPerf CPU s | load 1-min before → after |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in runs:
        s = r.summary
        err = f" ({s.errors} errors)" if s.errors else ""
        cached = _fmt(s.cached_pct, 0) if r.log_cached_pct is None else f"{r.log_cached_pct:.0f} (its log)"
        rows.append(f"| {r.profile.label} | {r.server}{err} | {_fmt(s.ttft_p50_s)} / {_fmt(s.ttft_p99_s)} "
                    f"| {_fmt(s.itl_p50_s, 3)} / {_fmt(s.itl_p99_s, 3)} "
                    f"| {_fmt(s.latency_p50_s)} / {_fmt(s.latency_p99_s)} | {_fmt(s.output_tok_s)} "
                    f"| {_fmt(s.output_tokens_mean, 1)} | {_fmt(s.prompt_tokens_mean, 0)} | {cached} "
                    f"| {_fmt(r.aiperf_cpu_s, 1)} | {r.load_before[0]:.2f} → {r.load_after[0]:.2f} |")
    return "\n".join([head, *rows])


# --- running it ---------------------------------------------------------------------------------------

def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages (other people's jobs share these 2 cores)."""
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def log_cached_pct(log_text: str, parse, warmup: int) -> float | None:
    """Cached % of prompt tokens over the requests a server logged, the first ``warmup`` (AIPerf's) left out.

    Args:
        parse: the target's ``log_usage`` (its log text -> (prompt, cached) per admitted request).
    """
    rows = parse(log_text)[warmup:]
    prompt = sum(p for p, _ in rows)
    return 100.0 * sum(c for _, c in rows) / prompt if prompt else None


def run_profile(profile: Profile, *, aiperf: Path, url: str, model: str, tokenizer: Path, out_dir: Path,
                timeout_s: float = 900.0) -> tuple[dict, float, float]:
    """Run AIPerf once and return its parsed export, its CPU seconds and its wall seconds.

    Raises:
        AIPerfError: a non-zero exit, a timeout, or no export file.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "aiperf.out"
    cmd = command(profile, aiperf=aiperf, url=url, model=model, tokenizer=tokenizer, out_dir=out_dir)
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    with open(log, "wb") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=aiperf_env(), timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    export = out_dir / EXPORT
    if rc != 0 or not export.is_file():
        raise AIPerfError(f"aiperf {profile.label} against {url}: exit {rc}; {log}:\n{log_tail(log)}")
    return json.loads(export.read_text()), cpu, wall


def measure(model_dir: Path, targets: Sequence[str], profiles: Sequence[Profile], out: Path, *,
            root: Path = ROOT, work: Path | None = None) -> tuple[list[Run], dict[str, str]]:
    """Each target alone on 127.0.0.1 in turn, every profile against it, AIPerf's files kept under ``out``.

    Returns:
        The runs, and for each target that failed (install, start or AIPerf) why; the others still run.
    """
    tool = venvs.ensure_venv(AIPERF, root)
    aiperf = tool.python.parent / "aiperf"
    runs: list[Run] = []
    failed: dict[str, str] = {}
    work = Path(work or tempfile.mkdtemp(prefix="aiperf-"))
    for name in targets:
        try:
            _measure_one(TARGETS[name], model_dir, profiles, out, runs, aiperf=aiperf, root=root, work=work)
        except ServingError as e:
            failed[name] = str(e)
            print(f"[aiperf] {name} failed: {e}", flush=True)
        log = work / _safe(name) / "server.log"
        if log.is_file():
            (out / name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(log, out / name / "server.log")
    shutil.rmtree(work, ignore_errors=True)
    return runs, failed


def _safe(name: str) -> str:
    return name.replace("/", "_")


def _measure_one(target: ServerTarget, model_dir: Path, profiles: Sequence[Profile], out: Path, runs: list[Run], *,
                 aiperf: Path, root: Path, work: Path) -> None:
    # appends to runs as it goes, so a later failure keeps the profiles that finished
    name = target.name
    venv = venvs.ensure_venv(target, root)
    versions = venv.pick(target.packages)
    print(f"[aiperf] starting {name}", flush=True)
    with processes.start(target, model_dir, processes.free_port(), work / _safe(name),
                         python=venv.python, root=root) as srv:
        blas = srv.blas_mapping().openblas
        for p in profiles:
            dest = out / name / p.label
            log_from = srv.log_path.stat().st_size
            before = loadavg()
            export, cpu, wall = run_profile(p, aiperf=aiperf, url=srv.url, model=srv.model,
                                            tokenizer=model_dir, out_dir=work / "aiperf" / name / p.label)
            after = loadavg()
            dest.mkdir(parents=True, exist_ok=True)
            for f in KEPT:
                if (work / "aiperf" / name / p.label / f).is_file():
                    shutil.copy2(work / "aiperf" / name / p.label / f, dest / f)
            from_log = None
            if target.log_usage is not None:
                with open(srv.log_path, "rb") as f:
                    f.seek(log_from)
                    from_log = log_cached_pct(f.read().decode(errors="replace"), target.log_usage, p.warmup)
            run = Run(name, p, summarize(export), before, after, round(cpu, 2), round(wall, 2),
                      str(dest.relative_to(out)), blas=blas, versions=versions, log_cached_pct=from_log)
            runs.append(run)
            print(f"[aiperf] {name} {p.label}: {json.dumps(asdict(run.summary))} load {before} -> {after}",
                  flush=True)


def write_results(runs: Sequence[Run], out: Path, meta: Mapping) -> Path:
    """``summary.json`` (every figure, the load, versions) and ``summary.md`` (the table) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({**meta, "runs": [asdict(r) for r in runs]}, indent=1))
    md = out / "summary.md"
    md.write_text(f"# AIPerf {VERSION} against EXP-009's servers: {meta.get('run_id', '')}\n\n"
                  f"Model `{meta.get('model_dir')}`, AIPerf's own export summarized "
                  f"(times in seconds; load is `/proc/loadavg` on {os.cpu_count()} cores).\n\n"
                  f"{markdown_table(runs)}\n"
                  + "".join(f"\n{name} failed: {why.splitlines()[0]}\n" for name, why in (meta.get("failed") or {}).items()))
    return md


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.trials.serving.aiperf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a registered model name or a model directory")
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated server names")
    ap.add_argument("--profiles", default="random,shared", help=f"comma-separated: {', '.join(PROFILES)}")
    ap.add_argument("--requests", type=int, default=None, help="override every profile's request count")
    ap.add_argument("--out", type=Path, default=None, help=f"results folder (default {RESULTS}/<run id>)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose .peers/ holds the venvs")
    args = ap.parse_args(argv)

    from harness import models

    model_dir = Path(models.resolve(args.model, variant=models.default_variant("auto")))
    profiles = [p for name in args.profiles.split(",") for p in PROFILES[name]]
    if args.requests:
        profiles = [Profile(**{**asdict(p), "requests": args.requests}) for p in profiles]
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{model_dir.name}"
    out = args.out or ROOT / RESULTS / run_id
    targets = [t for t in args.targets.split(",") if t]
    tool = venvs.ensure_venv(AIPERF, args.root)
    from harness.environment import git_info

    meta = {"run_id": run_id, "model_dir": str(model_dir), "targets": targets,
            "profiles": [asdict(p) for p in profiles], "aiperf": VERSION,
            "aiperf_venv": str(tool.python.parent.parent), "aiperf_install_s": tool.install_s,
            "aiperf_versions": tool.pick(["aiperf", "transformers", "tokenizers", "aiohttp", "torch"]),
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "git": git_info(ROOT),
            "load_at_start": loadavg()}
    runs, failed = measure(model_dir, targets, profiles, out, root=args.root)
    meta.update(load_at_end=loadavg(), failed=failed)
    print(write_results(runs, out, meta).read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
