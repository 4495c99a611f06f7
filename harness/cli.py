"""``python -m harness``: prepare models and run measurements."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.criteria import must_haves_pass


def _models(args) -> int:
    from harness import device, models

    device.ensure_working_device()  # the variant follows the device, and preparing f32 computes on it
    if args.action == "list":
        for name, src in sorted(models.REGISTRY.items()):
            state = models.resolve(name) if models.is_prepared(name) else "not prepared"
            print(f"{name:16} hub={src.hf_repo:40} {state}")
        return 0
    names = sorted(models.REGISTRY) if args.name in (None, "all") else [args.name]
    # The exact conversion always, and the variant this device computes with (f32 on a CPU).
    variants = list(dict.fromkeys(["quantized", models.default_variant(args.variant)]))
    for name in names:
        for variant in variants:
            if args.action == "prepare":
                was = models.variant_prepared(name, variant) and not args.force
                path = models.prepare(name, force=args.force, variant=variant)
                print(f"{name} ({variant}): {'already prepared' if was else 'prepared'} at {path}")
            else:  # path
                print(models.resolve(name, variant))
    return 0


def _run(args) -> int:
    from harness import config
    from harness import runner

    try:
        cfg = config.load(args.config, overrides=args.set, quick=args.quick)
    except config.ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    paths = runner.run(cfg, Path(args.out), verbose=args.verbose)
    return exit_code([json.loads(p.read_text()) for p in paths], strict=args.strict)


def exit_code(docs: list[dict], strict: bool = False) -> int:
    """0 when every must-have passed (``strict``: every criterion), else 1; a skipped run measured nothing
    and fails nothing."""
    docs = [d for d in docs if d["verdict"] != "SKIP"]
    if strict:
        return 0 if all(d["verdict"] == "PASS" for d in docs) else 1
    return 0 if all(must_haves_pass(d["criteria"]) for d in docs) else 1


def _list(args) -> int:
    from harness import config
    from harness.trials import KINDS

    for path in sorted(Path(args.dir or config.PACKAGED).glob("*.toml")):
        try:
            cfg = config.load(path)
            print(f"{path}  kind={cfg.kind}  models={','.join(cfg.models)}\n    {cfg.description}")
        except config.ConfigError as exc:
            print(f"{path}  INVALID: {exc}")
    print("kinds: " + ", ".join(sorted(KINDS)))
    return 0


def _compare(args) -> int:
    from harness.analysis import compare

    return compare.main(args.results, factor=args.factor, alpha=args.alpha)


def _compare_commits(args) -> int:
    """EXP-022 with ``ref`` (and ``new``) set: this checkout against an earlier commit, every turn type."""
    sets = [f"params.ref={json.dumps(args.ref)}", f"params.new={json.dumps(args.new)}", *args.set]
    if args.models:
        sets.append("params.models=" + json.dumps(args.models.split(",")))
    run_args = argparse.Namespace(config="exp_022_commit_compare", set=sets, quick=args.quick, out=args.out,
                                  verbose=False, strict=False)
    return _run(run_args)


def _report(args) -> int:
    from harness import console, old_names

    paths = []
    for item in args.results:
        p = Path(item)
        paths += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    if not paths:
        print("no results found", file=sys.stderr)
        return 2
    for p in paths:
        try:
            doc = old_names.upgrade(json.loads(p.read_text()))
            print(console.summary(doc, p, verbose=True))
        except (OSError, ValueError, KeyError) as exc:
            print(f"{p}: not a results document ({exc})", file=sys.stderr)
            return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="list, prepare or locate the named models")
    m.add_argument("action", choices=["list", "prepare", "path"])
    m.add_argument("name", nargs="?", help="a registered model name, or 'all' (default)")
    m.add_argument("--force", action="store_true", help="convert again even if prepared")
    m.add_argument("--variant", default=None, choices=["auto", "quantized", "f32"],
                   help="compute variant prepared beside the exact conversion (default: this device's, "
                        "$SEMANTIC_MODEL_VARIANT or f32 on a CPU)")
    m.set_defaults(func=_models)

    r = sub.add_parser("run", help="run an experiment config")
    r.add_argument("config", help="a config file, or a packaged config's name (python -m harness list)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, dotted (params.history_tokens=64, protocol.trials=3)")
    r.add_argument("--quick", action="store_true", help="apply the config's [quick] overrides (CPU-sized)")
    r.add_argument("--out", default="results", help="results root (default: results)")
    r.add_argument("--strict", action="store_true",
                   help="exit 1 when any criterion fails, not only a must-have (P0): for CI")
    r.add_argument("-v", "--verbose", action="store_true", help="also print every metric's p50 and p95")
    r.set_defaults(func=_run)

    ls = sub.add_parser("list", help="list experiment configs and kinds")
    ls.add_argument("--dir", default=None, help="a folder of configs (default: the packaged ones)")
    ls.set_defaults(func=_list)

    c = sub.add_parser("compare", help="compare result files; exit 1 on a flagged regression")
    c.add_argument("results", nargs="+", help="results JSON files; the first is the baseline")
    c.add_argument("--factor", type=float, default=1.10, help="median ratio that counts as a change (default 1.10)")
    c.add_argument("--alpha", type=float, default=0.01, help="Mann-Whitney U significance level (default 0.01)")
    c.set_defaults(func=_compare)

    cc = sub.add_parser("compare-commits", help="this checkout against an earlier commit: every turn type, "
                        "paired on this machine (EXP-022); exit 1 on a turn type slower beyond noise with --strict")
    cc.add_argument("ref", help="the earlier commit (a sha, a tag, HEAD~3; '.' compares this checkout with itself)")
    cc.add_argument("--new", default=".", help="the new side (default '.': this checkout as it stands)")
    cc.add_argument("--models", default="", help="comma-separated models (default: the config's)")
    cc.add_argument("--quick", action="store_true", help="the config's short version")
    cc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other override")
    cc.add_argument("--out", default="results", help="results root (default: results)")
    cc.set_defaults(func=_compare_commits)

    rep = sub.add_parser("report", help="print verdicts and medians of result files or folders")
    rep.add_argument("results", nargs="+")
    rep.set_defaults(func=_report)

    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (LookupError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
