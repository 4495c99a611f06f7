"""EXP-020: the models and contexts users run, at real cache geometry and real lengths.

Per geometry (``harness.trials.real_geometry.models``: Qwen3-Coder-30B-A3B, Llama 3.1 8B, Gemma 3 12B,
Qwen3.5-35B-A3B caches on tiny random bfloat16 bodies) and per agent length (8K ... 128K tokens), the agent's
cache is written synthetically (``synthetic``: random K/V of the real shapes, through our store, into the
server's directory, under its fingerprint). Then:

1. **in this process** (``inproc``): our save and restore beside mlx-lm's ``save_prompt_cache`` /
   ``load_prompt_cache`` and the floors (an fsync'd sequential write, a sequential read cold and warm, a
   memcpy), interleaved rep by rep;
2. **no pool flags** (``serving.default_flags``): ``semantic serve`` started with nothing but the model and the
   cache directory, and the agent's turn sent: served or refused, and what it said;
3. **one server sized for the agent** (``--pool-mb`` and ``--ram-mb`` from the spec's own arithmetic,
   ``--no-speculation`` so a decode step is one token): restores after a restart, cold (beside a cold
   sequential read of the same files) and warm (beside a memcpy of as many bytes); the fully cached turn
   against a decode step at that context; the cached turn right after another agent's saved turn against
   its quiet twin; the process's RSS every 100 ms against the budget it logged.

``restores`` adds geometries and lengths measured by their restores alone (step 3's cold and warm restores
and their peak memory, then the cached turn against a decode step, on a server sized the same): the quick
run's attention model at 32K, whose other phases would take minutes here.

What this machine cannot hold is skipped, not attempted: a length whose server would need more than the memory
available now (``server_factor`` x the cache's bytes; the restore reads every block and then concatenates them)
is recorded with the reason.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from harness.trials.base import TrialKind, Param, register
from harness.trials.real_geometry.report import checks, label, metrics, readme
from semantic import sizing

MiB = 1 << 20


def validate(p: dict) -> None:
    from harness.trials.real_geometry.models import GEOMETRIES

    bad = [g for g in p["geometries"] if g not in GEOMETRIES]
    if bad:
        raise ValueError(f"unknown geometries {bad}; known: {list(GEOMETRIES)}")
    if any(n % 256 for n in p["lengths"]):
        raise ValueError(f"lengths must be whole 256-token blocks: {p['lengths']}")
    for pair in p["restores"]:
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] in GEOMETRIES and isinstance(pair[1], int)
                and pair[1] > 0 and pair[1] % 256 == 0):
            raise ValueError(f"restores: [geometry, tokens in whole 256-token blocks] pairs; got {pair!r}")


def mem_available() -> int:
    return sizing.Machine.read().memory


def cache_bytes(spec, n: int) -> int:
    """The bytes an agent of ``n`` tokens holds: every layer's held tokens' K/V (a window: its last tokens),
    a recurrent layer's arrays."""
    import numpy as np

    from semantic.cache.spec import RECURRENT

    total = 0
    for layer in spec.layers:
        if layer.kind == RECURRENT:
            total += sum(math.prod(shape) * np.dtype(dt if dt != "bfloat16" else "float16").itemsize
                         for shape, dt in layer.arrays)
        else:
            size = 2 if layer.dtype in ("bfloat16", "float16") else 4
            total += layer.tokens_held(n) * layer.n_kv_heads * (layer.head_dim + layer.v_head_dim) * size
    return total


def pool_mb_for(spec, tokens: int) -> int:
    """The ``--pool-mb`` whose pool holds ``tokens`` tokens in one cache by the server's own arithmetic
    (``Service.open``: every block charged every layer's bytes per token plus a share of the snapshots;
    ``longest_cache``: each layer group needs its blocks)."""
    from semantic.cache.snapshots import SnapshotPositions

    bt = 256
    grid = SnapshotPositions(spec, bt).interval // bt
    block_bytes = spec.token_bytes() * bt + spec.state_bytes() / grid
    blocks = len(spec.groups()) * (tokens // bt + 4)
    return math.ceil(blocks * block_bytes / MiB) + 16


def run(ctx) -> None:
    from harness.servers.targets import ROOT
    from harness.trials.real_geometry import floors

    p = ctx.params
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])])
    work = Path(tempfile.mkdtemp(prefix="exp020-", dir=p["work_dir"] or None))
    bufs = floors.Buffers()
    out: dict = {"machine": {**floors.machine(bufs), "mem_available_bytes_at_start": mem_available(),
                             "cpu_count": os.cpu_count(), "work_dir": str(work)},
                 "geometries": {}, "failed": [], "skipped": []}
    ctx.progress.total = len(p["geometries"]) * len(p["lengths"]) + len(p["restores"])
    t_run = time.perf_counter()
    try:
        for g in p["geometries"]:
            try:
                out["geometries"][g] = _geometry(g, p, work / g, bufs, out, ctx)
            except Exception as exc:  # recorded (a P0 fails); the other geometries still run
                out["failed"].append({"part": g, "error": "".join(traceback.format_exception(exc))[-6000:]})
                print(f"EXP-020 {g} failed: {exc}", file=sys.stderr)
        for g, n in p["restores"]:
            try:
                _restores_of(g, n, p, work / g, bufs, out, ctx)
            except Exception as exc:
                out["failed"].append({"part": f"{g} restores", "error": "".join(traceback.format_exception(exc))[-6000:]})
                print(f"EXP-020 {g} restores failed: {exc}", file=sys.stderr)
    finally:
        if not p["keep_work_dir"]:
            shutil.rmtree(work, ignore_errors=True)
    out["wall_s"] = time.perf_counter() - t_run
    _record(ctx, out)


def _geometry(g: str, p: dict, work: Path, bufs, out: dict, ctx) -> dict:
    geo, spec, model_dir = _described(g, p)
    for n in p["lengths"]:
        _part(geo["lengths"], label(n), g, work, out, lambda lab: _length(g, n, p, work / lab, bufs, spec, geo, model_dir, out))
        ctx.progress.update(1)
    geo["fleets"] = {}
    for n, agents in p["fleets"]:
        _part(geo["fleets"], f"{agents}x{label(n)}", g, work, out,
              lambda lab: _fleet(g, n, agents, p, work / lab, spec, geo, model_dir, out))
    return geo


def _restores_of(g: str, n: int, p: dict, work: Path, bufs, out: dict, ctx) -> None:
    """Geometry ``g`` at ``n`` tokens measured by its restores alone (:func:`_restores`), into its geometry's
    lengths (made when ``geometries`` lacks it)."""
    if g not in out["geometries"]:
        out["geometries"][g] = _described(g, p)[0]
        out["geometries"][g]["fleets"] = {}
    geo = out["geometries"][g]
    _, spec, model_dir = _described(g, p)
    _part(geo["lengths"], label(n), g, work, out, lambda lab: _restores(g, n, p, work / lab, bufs, spec, geo, model_dir, out))
    ctx.progress.update(1)


def _described(g: str, p: dict) -> tuple[dict, object, Path]:
    """The geometry's model written (once per machine), its spec, and what the results say of it."""
    import gc

    import mlx.core as mx

    from harness.trials.real_geometry import models
    from semantic.service import model_fingerprint

    model_dir = models.write_model(g, p["model_root"] or None)
    model, spec = models.load_spec(model_dir)
    del model
    gc.collect()
    mx.clear_cache()
    geo = {"real": models.GEOMETRIES[g]["real"], "model_dir": str(model_dir), "fingerprint": model_fingerprint(model_dir),
           "context": models.context_of(g), "kv_bytes_per_token": models.GEOMETRIES[g]["kv_bytes_per_token"],
           "spec": {"layers": spec.n_layers, "kinds": {k: sum(l.kind == k for l in spec.layers) for k in
                                                       sorted({l.kind for l in spec.layers})},
                    "token_bytes": spec.token_bytes(), "state_bytes": spec.state_bytes(),
                    "groups": len(spec.groups())},
           "lengths": {}}
    return geo, spec, model_dir


def _part(into: dict, lab: str, g: str, work: Path, out: dict, measure) -> None:
    """``into[lab] = measure(lab)`` with its wall time; a failure is recorded (a P0 fails) and the other parts
    still run; its work directory goes either way."""
    t0 = time.perf_counter()
    try:
        into[lab] = measure(lab)
    except Exception as exc:
        out["failed"].append({"part": f"{g} {lab}", "error": "".join(traceback.format_exception(exc))[-6000:]})
        print(f"EXP-020 {g} {lab} failed: {exc}", file=sys.stderr)
    finally:
        shutil.rmtree(work / lab, ignore_errors=True)
        if lab in into:
            into[lab]["wall_s"] = time.perf_counter() - t0


def _fleet(g: str, n: int, agents: int, p: dict, work: Path, spec, geo: dict, model_dir: Path, out: dict) -> dict:
    """``agents`` agents of ``n`` tokens written into one directory, then a server with no pool flags serves each
    one's turn after a restart and its next turn (``serving.fleet``); skipped when the disk cannot hold them."""
    from harness.trials.real_geometry import serving
    from harness.trials.real_geometry.synthetic import token_ids, write_agent

    row: dict = {"tokens": n, "agents": agents, "cache_bytes": cache_bytes(spec, n) * agents,
                 "mem_available_bytes": mem_available()}
    if n + 2 * p["new_tokens"] + 1 > geo["context"]:
        row["skipped"] = f"{n} tokens + two turns do not fit the model's context ({geo['context']})"
    elif shutil.disk_usage(work.parent if work.parent.exists() else tempfile.gettempdir()).free < 1.2 * row["cache_bytes"]:
        row["skipped"] = f"the disk cannot hold {agents} agents of {row['cache_bytes'] / 2**30:.1f} GiB"
    if "skipped" in row:
        out["skipped"].append({"part": f"{g} {agents}x{label(n)}", "why": row["skipped"]})
        return row
    work.mkdir(parents=True, exist_ok=True)
    cache_dir = work / "cache"
    prompts, row["writes"] = {}, []
    for a in range(agents):
        ids = token_ids(n, p["seed"] + n + 1000 * a)
        row["writes"].append(write_agent(cache_dir, spec, geo["fingerprint"], f"agent-{a}", ids, p["seed"] + a))
        prompts[f"agent-{a}"] = serving.Growing(ids, p["new_tokens"], p["seed"] + n + 1000 * a + 1)
    _probe_memo(model_dir, cache_dir)
    row.update(serving.fleet(model_dir, g, cache_dir, work / "fleet.log", prompts, p["request_timeout_s"]))
    _probe_memo(cache_dir, model_dir)
    return row


def _length(g: str, n: int, p: dict, work: Path, bufs, spec, geo: dict, model_dir: Path, out: dict) -> dict:
    from harness.trials.real_geometry import inproc, serving
    from harness.trials.real_geometry.synthetic import token_ids

    nbytes = cache_bytes(spec, n)
    row: dict = {"tokens": n, "cache_bytes": nbytes, "mem_available_bytes": mem_available()}
    why = _unfit(n, p["new_tokens"] * (2 * p["restore_reps"] + 4) + p["decode_tokens"], nbytes, p, geo,
                 row["mem_available_bytes"])
    if why:
        out["skipped"].append({"part": f"{g} {label(n)}", "why": why})
        return {**row, "skipped": why}
    work.mkdir(parents=True, exist_ok=True)
    cache_dir, inproc_dir = work / "cache", work / "inproc"
    inproc_dir.mkdir()
    ids = token_ids(n, p["seed"] + n)
    prompts = serving.Growing(ids, p["new_tokens"], p["seed"] + n + 1)
    # 1. in this process: the saves (and the server's copy of the agent), then the restores
    row["saves"] = inproc.saves(spec, geo["fingerprint"], ids, inproc_dir, p["inproc_reps"], bufs, p["seed"],
                                also_into=cache_dir)
    two = 2 * nbytes + p["reserve_mb"] * MiB <= mem_available()
    if p["inproc_reps"]:
        row["loads"] = inproc.loads(spec, geo["fingerprint"], n, inproc_dir, p["inproc_reps"], bufs, warm=two)
    shutil.rmtree(inproc_dir, ignore_errors=True)
    _probe_memo(model_dir, cache_dir)
    # 2. no pool flags
    if p["default_flags"]:
        row["default"] = serving.default_flags(model_dir, g, cache_dir, work / "default.log", prompts.next(),
                                               p["request_timeout_s"])
    # 3. a server sized for the agent
    row["server"] = _sized_server(g, n, p, work, bufs, spec, model_dir, cache_dir, prompts, warm=two)
    row["prompt_tokens"] = len(prompts.last)
    _probe_memo(cache_dir, model_dir)
    return row


PROBE_MEMO = "batchprobe.json"


def _restores(g: str, n: int, p: dict, work: Path, bufs, spec, geo: dict, model_dir: Path, out: dict) -> dict:
    """The agent of ``n`` tokens written into a server's directory, then only the sized server's restores
    (:func:`_sized_server`'s, cold and warm, ``restore_reps`` each) with their peak memory, and its fully cached
    turn against a decode step (the forward a restore's read could overlap with, at best)."""
    from harness.trials.real_geometry import serving
    from harness.trials.real_geometry.synthetic import token_ids, write_agent

    nbytes = cache_bytes(spec, n)
    row: dict = {"tokens": n, "cache_bytes": nbytes, "mem_available_bytes": mem_available(), "restores_only": True}
    why = _unfit(n, p["new_tokens"] * (2 * p["restore_reps"] + 2) + p["decode_tokens"], nbytes, p, geo,
                 row["mem_available_bytes"])
    if why:
        out["skipped"].append({"part": f"{g} {label(n)} restores", "why": why})
        return {**row, "skipped": why}
    work.mkdir(parents=True, exist_ok=True)
    cache_dir = work / "cache"
    ids = token_ids(n, p["seed"] + n)
    row["write"] = write_agent(cache_dir, spec, geo["fingerprint"], serving.LONG, ids, p["seed"])
    prompts = serving.Growing(ids, p["new_tokens"], p["seed"] + n + 1)
    warm = 2 * nbytes + p["reserve_mb"] * MiB <= mem_available()
    _probe_memo(model_dir, cache_dir)
    row["server"] = _sized_server(g, n, p, work, bufs, spec, model_dir, cache_dir, prompts, warm, every_phase=False)
    row["prompt_tokens"] = len(prompts.last)
    _probe_memo(cache_dir, model_dir)
    return row


def _unfit(n: int, turns: int, nbytes: int, p: dict, geo: dict, avail: int) -> str | None:
    """Why an agent of ``n`` tokens (``nbytes`` of cache) and ``turns`` more tokens is not run here, or None: the
    model's context, or the memory ``avail``able now (``server_factor`` x its bytes and ``reserve_mb``)."""
    if n + turns + 1 > geo["context"]:
        return f"{n} tokens + the turns do not fit the model's context ({geo['context']})"
    need = p["server_factor"] * nbytes + p["reserve_mb"] * MiB
    if need > avail:
        return (f"a server restoring {nbytes / 2**30:.1f} GiB needs about {need / 2**30:.1f} GiB "
                f"(x{p['server_factor']} + {p['reserve_mb']} MiB); {avail / 2**30:.1f} GiB available now")
    return None


def _probe_memo(src: Path, dst: Path) -> None:
    """Carry the server's own batch-probe answer (``semantic.runner.batchprobe``: kept in its cache directory,
    keyed by the mlx and mlx-lm versions) between this run's fresh cache directories and the model's: a server
    asks once per model, as it would across restarts on one directory, not once per length (a minute's
    forward passes on a CPU for a Gated DeltaNet model)."""
    if (src / PROBE_MEMO).is_file() and not (dst / PROBE_MEMO).exists():
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / PROBE_MEMO, dst / PROBE_MEMO)


def _sized_server(g, n, p, work, bufs, spec, model_dir, cache_dir, prompts, warm: bool, every_phase: bool = True) -> dict:
    """A server sized for the agent: its first turn, its restores cold and warm, its cached turn against a decode
    step, and a cached turn beside another agent's save; without ``every_phase``, the restores and the cached
    turn alone (the first turn and the saves beside left out)."""
    from harness.trials.real_geometry import serving

    room = n + p["new_tokens"] * (2 * p["restore_reps"] + 3) + p["decode_tokens"] + 512
    room += p["beside_tokens"] * (p["beside_reps"] + 1) if every_phase else 0
    pool = pool_mb_for(spec, room)
    args = ["--pool-mb", str(pool), "--ram-mb", str(pool), "--no-speculation", *p["server_args"]]
    s = serving.Served(model_dir, g, cache_dir, work / "server.log", args, p["request_timeout_s"])
    res: dict = {"args": args, "restore": [], "cached": [], "beside": []}
    s.sampler.start()
    try:
        s.start("start")
        if every_phase:
            time.sleep(1.0)                         # a second of samples of the idle server
            s.sampler.phase = "first"
            res["first"] = s.turn(prompts.next())   # the agent's first turn on this server
            s.wait_idle()
        for r in range(p["restore_reps"]):
            for cold in ((True, False) if r % 2 == 0 else (False, True)):
                if cold or warm:
                    res["restore"].append(serving.restore(s, prompts.next(), r, cold, bufs))
        s.sampler.phase = "cached"
        s.wait_idle()
        prompt = prompts.next()
        res["cached_first"] = s.turn(prompt)   # its new tokens computed: from here on all but the last are cached
        res["cached"] = serving.cached_vs_decode(s, prompt, p["cached_reps"], p["decode_tokens"])
        if every_phase:
            s.sampler.phase = "beside"
            res["beside"] = serving.beside_save(s, prompt, p["beside_reps"], p["beside_tokens"], p["seed"] + 7 * n)
        res["stats"] = {k: v for k, v in (s.server.stats(timeout_s=30) or {}).items() if k not in ("agents", "recent")}
    except Exception as exc:
        raise RuntimeError(f"{exc!r}\n--- server log ---\n{s.server.log_tail(4000)}") from exc
    finally:
        s.sampler.stop()
        s.stop()
        s.kill()
        res["lives"] = s.lives
        res["rss"] = _rss_summary(s.sampler.rss)
    return res


def _rss_summary(rows: list[dict]) -> dict:
    """The largest RSS sample per phase and overall (and its file-backed part), and the sample count."""
    by: dict = {}
    for r in rows:
        by[r["phase"]] = max(by.get(r["phase"], 0), r["rss_bytes"])
    peak = max(rows, key=lambda r: r["rss_bytes"], default=None)
    return {"samples": len(rows), "max_bytes": peak["rss_bytes"] if peak else None,
            "max_file_bytes": peak["file_bytes"] if peak else None, "max_by_phase": by,
            "trace": [[r["t"], r["phase"], r["rss_bytes"]] for r in rows[:: max(1, len(rows) // 400)]]}


def _record(ctx, out: dict) -> None:

    c = checks(out)
    ctx.results.checks(c)
    for name, (values, unit, desc) in metrics(out).items():
        ctx.results.metric(name, values, unit, description=desc)
    for k in ("machine", "geometries", "failed", "skipped", "wall_s"):
        ctx.results.output(k, out.get(k))
    (ctx.out_dir / "README.md").write_text(readme(ctx, out, c))


KIND = register(TrialKind(
    name="real_geometry",
    run=run,
    validate=validate,
    params={
        "geometries": Param(list, ["qwen3-coder-30b-a3b", "llama-3.1-8b", "gemma-3-12b", "qwen3.5-35b-a3b"],
                            "geometries (harness.trials.real_geometry.models.GEOMETRIES)"),
        "lengths": Param(list, [8192, 16384, 32768, 65536, 130816], "agent lengths in tokens (whole blocks)", min=256),
        "restores": Param(list, [], "[geometry, tokens] pairs measured by their restores alone (cold and warm, "
                                    "restore_reps each, and their peak memory) on a server sized for the agent"),
        "fleets": Param(list, [], "[tokens, agents] pairs: that many agents of that length served by one server with no "
                                  "pool flags, each restored from disk then resumed, its RSS against the budget it logged"),
        "new_tokens": Param(int, 2, "new tokens each turn after a restart appends to the agent's last prompt", min=2),
        "inproc_reps": Param(int, 2, "in-process rounds of each save and restore (0: no restores)", min=0),
        "default_flags": Param(bool, True, "start a server with no pool flags and send the agent's turn"),
        "restore_reps": Param(int, 2, "restarts per cold and per warm restore", min=0),
        "cached_reps": Param(int, 3, "pairs of a cached turn and a longer one", min=1),
        "decode_tokens": Param(int, 4, "extra tokens the longer turn generates (its decode steps)", min=1),
        "beside_reps": Param(int, 3, "pairs of a cached turn beside a save and its quiet twin", min=1),
        "beside_tokens": Param(int, 512, "the other agent's fresh tokens (prefilled, then saved)", min=1),
        "server_factor": Param(float, 2.2, "a length runs when this many times its cache's bytes are available"),
        "reserve_mb": Param(int, 1536, "memory left aside for the rest of the machine, MiB"),
        "request_timeout_s": Param(float, 1800.0, "the client's bound on every request"),
        "server_args": Param(list, [], "more arguments for the sized server"),
        "seed": Param(int, 0, "token ids' and arrays' seed"),
        "model_root": Param(str, "", "where the model directories go (default: ~/.cache/semantic-kv/models)"),
        "work_dir": Param(str, "", "where caches and logs go (default: the system's temporary directory)"),
        "keep_work_dir": Param(bool, False, "leave the work directory behind"),
    },
    needs_model=False,
))
