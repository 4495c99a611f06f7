"""``python -m harness.matrix [--short] [--types a,b] [--out DIR] [--jobs N]``: the support matrix.

Every model type ``harness.models.zoo`` builds is checked twice (``check.check``:
with the echo, and with ``--no-echo-history``); the results go to
``results/model-matrix/<mlx-lm version>.json`` and a markdown table that the
README quotes. A type that cannot be served is a row with its reason, never a pass.
With ``--jobs`` N > 1 the types are dealt round-robin to N child runs of this module, each into a
folder of its own, and their rows merged into one file (a check is a server and a client, most of
it single-threaded: two of them side by side halve the full run on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from harness import noise
from harness.matrix.check import REUSE_TURNS, ModelResult, TurnResult, check

# the short run in ``make test``: plain global attention (the commonest kind), and one of each kind that
# needs a snapshot or shares KV
SHORT = ("llama", "qwen3_next", "lfm2", "gpt_oss", "gemma4_text", "falcon_h1")


def run(types: list[str], out: Path, update: bool = False, jobs: int = 1) -> list[ModelResult]:
    """Check ``types``, ``jobs`` child runs at a time; with ``update``, the results file keeps its other
    types' rows (a rerun of a few)."""
    if jobs > 1 and len(types) > 1:
        return write(_in_children(types, jobs), out, types, update)
    results = []
    for t in types:
        with tempfile.TemporaryDirectory(prefix=f"matrix-{t}-") as tmp:
            for echo in (True, False):
                if not echo and results[-1].error and not (Path(tmp) / "model" / "config.json").exists():
                    r = ModelResult(t, False, error=results[-1].error)  # no model to serve: the same reason
                else:
                    r = check(t, Path(tmp), echo=echo)
                results.append(r)
                print(_line(r), flush=True)
    return write(results, out, types, update)


def shares(types: list[str], jobs: int) -> list[list[str]]:
    """``types`` dealt round-robin to ``jobs`` runs (neighbours in the zoo's order are often one family, of
    about one cost), none empty."""
    return [s for s in (types[k::jobs] for k in range(jobs)) if s]


def _in_children(types: list[str], jobs: int) -> list[ModelResult]:
    """Each share of ``types`` checked by a child run of this module into a folder of its own; their rows."""
    with tempfile.TemporaryDirectory(prefix="matrix-jobs-") as tmp:
        parts = [Path(tmp) / str(k) for k in range(jobs)]
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # the children share the cores: no BLAS threads
        children = [subprocess.Popen([sys.executable, "-m", "harness.matrix", "--types", ",".join(share),
                                      "--out", str(part), "--jobs", "1"], env=env)
                    for share, part in zip(shares(types, jobs), parts)]
        codes = [c.wait() for c in children]
        if any(codes):
            raise RuntimeError(f"a child run of the matrix exited {codes}: its rows are missing")
        name = f"mlx-lm-{version('mlx-lm')}.json"
        return [_result(r) for part in parts if (part / name).exists()
                for r in json.loads((part / name).read_text())["results"]]


def write(results: list[ModelResult], out: Path, types: list[str], update: bool = False) -> list[ModelResult]:
    """``results`` into ``out``'s JSON and markdown table for this mlx-lm, sorted by type; with ``update``,
    the file's rows of types other than ``types`` stay."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"mlx-lm-{version('mlx-lm')}.json"
    rows = sorted((r.to_json() for r in results), key=lambda r: (r["model_type"], not r["echo"]))
    if update and path.exists():
        rows = [r for r in json.loads(path.read_text())["results"] if r["model_type"] not in types] + rows
        rows.sort(key=lambda r: (r["model_type"], not r["echo"]))
    doc = {"mlx_lm": version("mlx-lm"), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": rows}
    path.write_text(json.dumps(doc, indent=1))
    (out / f"mlx-lm-{version('mlx-lm')}.md").write_text(table([_result(r) for r in rows]))
    return results


def _result(row: dict) -> ModelResult:
    turns = [TurnResult(**t) for t in row["turns"]]
    return ModelResult(row["model_type"], row["echo"], row["cache_kinds"], turns, row["error"], row["seconds"])


def _line(r: ModelResult) -> str:
    if r.error:
        return f"{r.model_type:26s} {'echo' if r.echo else 'no-echo':8s} NOT SUPPORTED: {r.error}"
    cached = " ".join(f"{t.turn}={t.cached}/{t.history}{'' if t.exact and t.reused else '!'}" for t in r.turns)
    return f"{r.model_type:26s} {'echo' if r.echo else 'no-echo':8s} {'PASS' if r.passed else 'FAIL'} {cached} ({r.seconds}s)"


def table(results: list[ModelResult]) -> str:
    """One row per model type: kinds, a verdict per check (echo / no echo), cached share per turn."""
    by_type: dict[str, dict[bool, ModelResult]] = {}
    for r in results:
        by_type.setdefault(r.model_type, {})[r.echo] = r
    passed = sum(all(r.passed for r in rs.values()) for rs in by_type.values())
    head = ["model type", "cache kinds", "exact", *REUSE_TURNS, "batch", "no-echo"]
    lines = [f"{passed} of {len(by_type)} model types pass every check (mlx-lm {version('mlx-lm')}).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    marked: list[str] = []
    for t, rs in sorted(by_type.items()):
        r = rs.get(True) or next(iter(rs.values()))
        if r.error:
            lines.append(f"| {t} | {', '.join(r.cache_kinds) or '-'} | not supported: {r.error} |" + " |" * (len(head) - 3))
            continue
        turns = {x.turn: x for x in r.turns}
        exact = "yes" if all(x.exact for x in r.turns) else "**no**"
        if any(x.noise > noise.CEILING for x in r.turns):
            exact += "†"
            marked.append(t)
        cells = [t, ", ".join(r.cache_kinds), exact]
        for name in REUSE_TURNS:
            x = turns.get(name)
            cells.append("-" if x is None else f"{'' if x.reused else '**'}{x.cached / max(x.history, 1):.0%}"
                                                f"{'' if x.reused else '**'}")
        batch = [x for x in r.turns if x.turn.startswith("batch_")]
        cells.append("yes" if batch and all(x.exact for x in batch) else "**no**")
        ne = rs.get(False)
        cells.append("-" if ne is None else "pass" if ne.passed else "**fail**")
        lines.append("| " + " | ".join(cells) + " |")
    if marked:
        lines += ["", f"† {', '.join(marked)}: this mlx-lm's own prefill in chunks disagrees with its one-token "
                      f"decode beyond float noise (over {noise.CEILING}), so no noise could be measured: each turn "
                      f"is held to the one-token decode within {noise.FLOOR:g} (the `noise` of each turn in the "
                      "JSON is the disagreement measured)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from harness.models import zoo

    p = argparse.ArgumentParser(prog="python -m harness.matrix")
    p.add_argument("--short", action="store_true", help=f"only {', '.join(SHORT)}")
    p.add_argument("--types", default="", help="comma-separated model types (default: all the zoo builds)")
    p.add_argument("--out", default="results/model-matrix")
    p.add_argument("--update", action="store_true", help="keep the other types' rows of the results file")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="checks run side by side, each in a child run (default: 2, or 1 on one core)")
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error(f"--jobs {a.jobs}: at least 1")
    types = [t for t in a.types.split(",") if t] or (list(SHORT) if a.short else zoo.model_types())
    results = run(types, Path(a.out), update=a.update, jobs=a.jobs)
    failed = [r for r in results if not r.passed and r.error is None]
    print(f"{sum(r.passed for r in results)} of {len(results)} runs pass; {len(failed)} fail; "
          f"{sum(r.error is not None for r in results)} not supported")
