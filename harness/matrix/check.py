"""One model type's support check: served turns against mlx-lm's own greedy decoding.

``check(model_type, workdir)`` writes the tiny random-weight model
(``harness.models.zoo``), runs ``harness.matrix.agent`` in a child process
(the live phase), SIGKILLs it once its saves are on disk, runs the restart
phase in a fresh child, and then holds every turn against
``mlx_lm.generate.generate_step`` on the very ids that turn was given:

- exact: the same greedy tokens (but after a near-tie), each logprob within the tolerance
  measured beside the reference (``harness.noise``: mlx-lm's own prefill of that turn in
  chunks on this machine, times SAFETY), recorded per turn with that noise. Where mlx-lm's
  chunked variant disagrees with its own one-token decode beyond float noise (``noise.CEILING``:
  a bug of that mlx-lm's model code, e.g. 0.30.4's gemma3n over a rotated window), there is no
  noise to measure: the turn is held to the one-token decode within ``noise.FLOOR``, the
  tightest tolerance any turn gets, and the table marks the type;
- reused: the turn's cache covered what an agent server should keep::

    append, branch     the whole previous turn of that branch (prompt + reply but its last token, which
                       is never fed), with the echo;
                       without it, at least the previous prompt but its last token
    regenerate         the whole prompt but its last token
    edit               everything before the edited message
    second_agent       the shared system prompt
    restart            the whole previous turn, from disk

A random-weight reply need not tokenize back to the ids it was generated as,
which is why each turn is compared on its own ids, and why the matrix runs
with the echo (the generated ids come back) and without it (the template's
text, tokenized again).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from semantic.cache.reuse import common_prefix

REUSE_TURNS = ("append", "regenerate", "edit", "append_after_edit", "branch", "second_agent", "restart")


@dataclass
class TurnResult:
    turn: str
    agent: str
    history: int
    cached: int
    want: int            # the tokens a good server keeps for this turn (see the module doc)
    exact: bool
    max_dlogprob: float
    # the reference's own spread on this machine, and the tolerance it gave max_dlogprob (harness.noise);
    # 0 in rows written before they were measured
    noise: float = 0.0
    tolerance: float = 0.0

    @property
    def reused(self) -> bool:
        return self.cached >= self.want


@dataclass
class ModelResult:
    model_type: str
    echo: bool
    cache_kinds: list[str] = field(default_factory=list)
    turns: list[TurnResult] = field(default_factory=list)
    error: str | None = None    # not supported: why (a row, not a pass)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.turns) and all(t.exact and t.reused for t in self.turns)

    def to_json(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        return out


def _child(model_dir: Path, cache: Path, phase: str, echo: bool, stdin: str | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "harness.matrix.agent", str(model_dir), str(cache), phase]
    return subprocess.Popen(argv + ([] if echo else ["--no-echo"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _lines(proc: subprocess.Popen, until_saved: bool, timeout_s: float) -> list[dict]:
    """The child's JSON lines, up to ``saved`` (then SIGKILL) or its exit; bounded by ``timeout_s``."""
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        doc = json.loads(line)
        out.append(doc)
        if until_saved and doc.get("saved"):
            proc.send_signal(signal.SIGKILL)
            break
    else:
        proc.kill()
    proc.wait(30)
    return out


def _fail(proc: subprocess.Popen) -> str:
    err = proc.stderr.read()[-2000:] if proc.stderr else ""
    last = [l for l in err.strip().splitlines() if l.strip()]
    return last[-1][:300] if last else f"exited {proc.returncode}"


def _wants(turns: dict[str, dict], echo: bool) -> dict[str, int]:
    """What each turn should have reused (see the module doc)."""
    def whole(prev: str) -> int:
        t = turns[prev]
        return len(t["ids"]) + len(t["tokens"]) - 1 if echo else len(t["ids"]) - 1

    def mark(name: str, other: str, pick) -> int:
        # where the service found the message boundary; a model that resumes anywhere has none
        # and keeps the whole common prefix (a boundary that was not found then fails the check)
        marks = turns[name]["boundaries"]
        return pick(marks) if marks else common_prefix(turns[name]["ids"], turns[other]["ids"])

    return {
        "first": 0, "append": whole("first"), "regenerate": len(turns["append"]["ids"]) - 1,
        "edit": mark("edit", "append", max), "append_after_edit": whole("edit"), "branch": whole("append"),
        "second_agent": mark("second_agent", "first", min), "restart": whole("branch"),
        **{n: 0 for n in turns if n.startswith("batch_")},
    }


def check(model_type: str, workdir: Path, echo: bool = True, timeout_s: float = 600) -> ModelResult:
    from harness.models import zoo

    result = ModelResult(model_type, echo)
    started = time.perf_counter()
    try:
        model_dir = workdir / "model"
        if not model_dir.exists():
            zoo.write_tiny(model_type, model_dir)
        cache = workdir / f"cache-{'echo' if echo else 'noecho'}"
        live = _child(model_dir, cache, "live", echo)
        lines = _lines(live, True, timeout_s)
        saved = next((l for l in lines if l.get("saved")), None)
        if saved is None:
            result.error = next((l["error"] for l in lines if "error" in l), None) or _fail(live)
            return result
        again = _child(model_dir, cache, "restart", echo)
        again.stdin.write(json.dumps(saved["last"]) + "\n")
        again.stdin.flush()
        lines += _lines(again, False, timeout_s)
        turns = {l["turn"]: l for l in lines if "turn" in l}
        if "restart" not in turns:
            result.error = f"restart: {_fail(again)}"
        result.turns = _compare(model_dir, turns, _wants(turns, echo))
        result.cache_kinds = _kinds(model_dir)
    except Exception as exc:  # a model type that cannot be served is a row with its reason
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result.seconds = round(time.perf_counter() - started, 1)
    return result


def _compare(model_dir: Path, turns: dict[str, dict], wants: dict[str, int]) -> list[TurnResult]:
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from harness import noise

    model, _ = mlx_lm.load(str(model_dir))
    out = []
    for name, t in turns.items():
        # generate_step's own caches, as the turn would get from mlx_lm.server; turns of ~900 tokens, hundreds
        # of them in the whole matrix: the noise of one teacher-forced prefill (noise.few_passes)
        ref = noise.reference(model, t["ids"], len(t["tokens"]), lambda: make_prompt_cache(model),
                              **noise.few_passes(t["ids"]))
        compared, exact, tol = judge(ref, t["tokens"], t["logprobs"], name)
        d = max((abs(a - b) for a, b in zip(t["logprobs"][:compared], ref.logprobs)), default=0.0)
        out.append(TurnResult(name, t["agent"], len(t["ids"]), t["cached"], wants.get(name, 0), exact, d,
                              ref.noise, tol))
    return out


def judge(ref, tokens: list[int], logprobs: list[float], name: str) -> tuple[int, bool, float]:
    """Steps compared, whether the turn is exact, and the tolerance it was held to: the noise measured beside
    ``ref``; or, where mlx-lm's own variants disagree beyond float noise (``noise.CEILING``), ``noise.FLOOR``
    against its one-token decode (no noise could be measured; the floor is stricter than any measured one)."""
    from harness import noise

    if ref.noise > noise.CEILING:
        ref = replace(ref, noise=0.0, pending=None)
    try:
        return ref.check(tokens, logprobs, name), True, ref.tolerance
    except AssertionError:
        return len(tokens), False, ref.tolerance


def _kinds(model_dir: Path) -> list[str]:
    import mlx_lm

    from semantic.cache.spec import ModelCacheSpec

    spec = ModelCacheSpec.from_model(mlx_lm.load(str(model_dir))[0])
    kinds = sorted({l.kind for l in spec.layers})
    return kinds + (["nested"] if spec.nesting else [])
