""".github/workflows/bench.yml cannot run here, so it is checked here: against
GitHub's workflow schema (check-jsonschema's vendored copy, offline), and for
what it promises: the macOS arm64 matrix over the oldest supported and the latest mlx,
the commands it runs, and make targets that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "bench.yml"


def _run_text(doc: dict) -> str:
    return "\n".join(step.get("run", "") for job in doc["jobs"].values() for step in job["steps"])


def test_the_workflow_validates_against_githubs_schema():
    exe = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(exe), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_workflow_runs_the_matrix_and_the_promised_commands():
    doc = yaml.safe_load(WORKFLOW.read_text())
    mac = doc["jobs"]["macos"]
    assert mac["runs-on"] == "macos-14"
    pins = [m["pins"] for m in mac["strategy"]["matrix"]["include"]]
    assert "mlx==0.30.3 mlx-lm==0.30.4" in pins and "" in pins  # the oldest supported versions and the latest
    text = _run_text(doc)
    for cmd in ("make test", "--benchmark-only", "--benchmark-json", "make exp-006", "harness compare", "bash .ci/run"):
        assert cmd in text, cmd
    assert doc["jobs"]["compare"]["needs"] == "macos"


def test_every_make_target_the_workflow_calls_exists():
    targets = set(re.findall(r"\bmake ([a-z0-9-]+)", _run_text(yaml.safe_load(WORKFLOW.read_text()))))
    assert targets
    for target in sorted(targets):
        done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"make {target}: {done.stderr}"
