"""``python -m harness``: prepare models and run measurements."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _models(args) -> int:
    from harness import models

    if args.action == "list":
        for name, src in sorted(models.REGISTRY.items()):
            state = models.prepared_dir(name) if models.is_prepared(name) else "not prepared"
            print(f"{name:16} hub={src.hf_repo:40} {state}")
        return 0
    names = sorted(models.REGISTRY) if args.name in (None, "all") else [args.name]
    for name in names:
        if args.action == "prepare":
            was = models.is_prepared(name) and not args.force
            path = models.prepare(name, force=args.force)
            print(f"{name}: {'already prepared' if was else 'prepared'} at {path}")
        else:  # path
            print(models.resolve(name))
    return 0


def _first_exp006(args) -> int:
    from harness.first_reconstruction import run

    run(args.model, args.blocks, args.trials, args.warmup, Path(args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("models", help="list, prepare or locate the named models")
    m.add_argument("action", choices=["list", "prepare", "path"])
    m.add_argument("name", nargs="?", help="a registered model name, or 'all' (default)")
    m.add_argument("--force", action="store_true", help="convert again even if prepared")
    m.set_defaults(func=_models)

    e = sub.add_parser("exp-006-first", help="first EXP-006 measurement: block concat vs memcpy")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--blocks", type=_int_list, default=[1, 2, 4, 8])
    e.add_argument("--trials", type=int, default=30)
    e.add_argument("--warmup", type=int, default=5)
    e.add_argument("--out", default="results/exp_006")
    e.set_defaults(func=_first_exp006)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (LookupError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
