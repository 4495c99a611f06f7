"""Processes a trial starts: a child is its experiment's ``child`` module, run as
``python -m harness.trials.EXPERIMENT.child SPEC.json``; :data:`CHILDREN` names them.

A child runs in a process of its own when what it measures needs one: a
fresh process that has only the cache files (``multiturn``, ``roundtrip``),
or a BLAS that is fixed when MLX loads (``throughput``). It reads everything
it needs from the spec file, prints one JSON line, and exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILDREN = {"multiturn": "harness.trials.multiturn.child",
            "roundtrip": "harness.trials.persistence_roundtrip.child",
            "throughput": "harness.trials.throughput.child"}


def run_child(name: str, spec: dict, what: str, env: dict | None = None) -> dict:
    """Run child ``name`` (``python -m CHILDREN[name] SPEC.json``, ``spec`` written to a temp file) and return the
    JSON object the child prints last.

    Raises:
        RuntimeError: naming ``what`` and the end of the child's stderr when it exits non-zero.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run([sys.executable, "-m", CHILDREN[name], f.name],
                              capture_output=True, text=True, env=env)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
