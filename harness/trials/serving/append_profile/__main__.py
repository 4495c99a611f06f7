"""``python -m harness.trials.serving.append_profile``: the flags, the parts they ask for, the summary printed and written."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from harness.trials.serving import append_profile
from harness.trials.serving.append_profile.engine import engine_part
from harness.trials.serving.append_profile.over_http import http_part
from harness.trials.serving.append_profile.report import summarize


def main(argv: list[str] | None = None) -> int:
    import semantic.blas

    semantic.blas.enable()  # before anything imports mlx: its BLAS is fixed at import
    from harness import models

    p = argparse.ArgumentParser(prog="python -m harness.trials.serving.append_profile",
                                description=append_profile.__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a registered model name (prepared by `make models`)")
    p.add_argument("--trials", type=int, default=5, help="timed samples per side")
    p.add_argument("--cached", type=int, default=2000, help="tokens of the first turn (the cache)")
    p.add_argument("--new", type=int, default=300, help="tokens the timed turn appends")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--http", action="store_true", help="also time both servers over HTTP")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process part")
    p.add_argument("--before", type=Path, help="another checkout of this project: its server joins the HTTP rotation")
    p.add_argument("--json", type=Path, help="write the samples and the summary here")
    a = p.parse_args(argv)
    model_dir = models.prepared_dir(a.model, models.default_variant(None))
    result: dict = {"model": a.model, "load_before": os.getloadavg()}
    if not a.no_engine:
        result["engine"] = engine_part(model_dir, a.trials, a.cached, a.new, a.max_tokens)
    if a.http:
        with tempfile.TemporaryDirectory(prefix="append-http-") as d:
            result["http"] = http_part(model_dir, a.trials, a.cached, a.new, a.max_tokens, Path(d), a.before)
    result["load_after"] = os.getloadavg()
    result["summary"] = summarize(result)
    print(json.dumps(result["summary"], indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
