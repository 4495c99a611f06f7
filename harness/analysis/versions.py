"""Measure one quick experiment under two Python environments, interleaved, and compare.

``python -m harness.analysis.versions --baseline .venv-compat/bin/python --candidate
.venv/bin/python CONFIG [--set ...] --rounds 2`` runs the config in the
baseline and candidate environments in turn (B C B C ...), so slow drift of
the machine hits both; pools each side's samples into one document per
side (same benchmark identity, so the same code measured the same thing),
and prints ``compare``'s table. Used by ``make compare-versions`` with
mlx-lm 0.30.4 as the baseline and the latest version as the candidate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import old_names, results, stats
from harness.analysis import compare


def _run(python: str, config: str, sets: list[str], out: Path) -> dict:
    cmd = [python, "-m", "harness", "run", config, "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    # exit 1 means a criterion failed, which is a result like any other
    rc = subprocess.run(cmd).returncode
    if rc not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed with exit status {rc}")
    (path,) = sorted(out.rglob("*.json"))
    return old_names.upgrade(json.loads(path.read_text()))


def pool(docs: list[dict]) -> dict:
    """One document with every run's samples per metric (stats recomputed)."""
    ids = {d["benchmark_id"] for d in docs}
    assert len(ids) == 1, f"runs measured different things: {ids}"
    merged = json.loads(json.dumps(docs[0]))
    for name, m in merged["metrics"].items():
        m["samples"] = [x for d in docs for x in d["metrics"][name]["samples"]]
        m["stats"] = stats.summarize(m["samples"])
    merged["outputs"]["pooled_runs"] = [d["run_id"] for d in docs]
    merged["verdict"] = "PASS" if all(d["verdict"] == "PASS" for d in docs) else "FAIL"
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.analysis.versions", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--baseline", required=True, help="python of the baseline environment")
    ap.add_argument("--candidate", required=True, help="python of the candidate environment")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="results/compare_versions")
    args = ap.parse_args(argv)

    sides: dict[str, list[dict]] = {"baseline": [], "candidate": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("baseline", "candidate"):
                python = args.baseline if side == "baseline" else args.candidate
                sides[side].append(_run(python, args.config, args.set, Path(tmp) / f"{side}-{r}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs, paths = [], []
    for side, runs in sides.items():
        doc = pool(runs)
        results.validate(doc)
        version = doc["packages"].get("mlx-lm", "unknown")
        path = out / f"{doc['experiment']}-mlx-lm-{version}-{side}.json"
        path.write_text(json.dumps(doc, indent=1) + "\n")
        docs.append(doc)
        paths.append(path)
    table = compare.format_table(compare.compare(docs, names=[str(p) for p in paths]))
    (out / "comparison.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
