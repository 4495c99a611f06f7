"""Whether a model's own code decodes a batch of caches exactly as it decodes each row alone.

The step loop batches rows of different lengths into left-padded batch caches
(``kinds.merge``), whose offsets are arrays. Some mlx-lm model types read a
cache's offset as one number (gpt_bigcode's position embeddings) or build a
mask that does not broadcast over a batch (gemma2's soft-capped attention), so
a batch fails or drifts there while one row at a time is exact. At load, two
short prompts of different lengths are decoded both ways::

    row 0   [t .. t] (9)     prefill, then one decode step alone   ─┐ same next-token logprobs,
    row 1   [t ..... t] (60) prefill, then one decode step alone   ─┤ within TOLERANCE?
    batch   both rows merged, one decode step                     ─┘ else: one sequence at a time

A model with recurrent layers is asked a second question (:func:`replay_problem`):
whether its code keeps a row's padding out of its recurrent state when told
the row's length (mlx-lm's ``ArraysCache.lengths``), which speculation needs
(``semantic.decode.replay``); a layer that ignores it (nemotron_h's SSM scan,
which both versions never hand the lengths; mamba) turns speculation off.

The probe costs a few tokens' forward passes (seconds on a CPU, every load of
a server that loads models on demand), so its answer is kept beside the
model's caches (:func:`remembered`) for the same mlx and mlx-lm versions; it
is the reason the executor runs such a model one sequence at a time
(``BatchExecutor``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import mlx.core as mx

from semantic import compat, kinds

# logprobs of a batch row against the same row alone: float32 matmuls over other shapes differ by ~1e-6
TOLERANCE = 1e-3
_PROMPTS = (tuple(range(1, 10)), tuple(range(20, 80)))  # 9 and 60 tokens: a row padded by 51
MEMO = "batchprobe.json"  # in the model's cache directory: one answer per question

log = logging.getLogger(__name__)


def remembered(model, spec, directory: Path | None, question=None) -> str | None:
    """``question`` (:func:`batch_problem` unless given), asked once per model and mlx / mlx-lm versions:
    its answer is kept in ``directory`` (the model's cache directory; None: asked every time)."""
    question = question or batch_problem
    key = "answer" if question is batch_problem else question.__name__
    versions = _versions()
    memo = Path(directory) / MEMO if directory is not None else None
    doc = {}
    if memo is not None:
        try:
            doc = json.loads(memo.read_text())
            if not isinstance(doc, dict) or doc.get("versions") != versions:
                doc = {}
            elif key in doc and (doc[key] is None or isinstance(doc[key], str)):
                return doc[key]
        except (OSError, ValueError):
            doc = {}  # none yet, or unreadable: ask the model
    answer = question(model, spec)
    if memo is not None:
        try:
            tmp = memo.with_name(f".{MEMO}.{os.getpid()}")
            tmp.write_text(json.dumps({**doc, "versions": versions, key: answer}))
            os.replace(tmp, memo)
        except OSError as exc:  # a read-only directory: the next load asks again
            log.debug("batch probe's answer not kept in %s: %s", memo, exc)
    return answer


def _versions() -> dict:
    import mlx_lm

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def batch_problem(model, spec) -> str | None:
    """Why ``model`` cannot decode a batch exactly (an error, or rows that drift), or None when it can."""
    try:
        caches = []
        for prompt in _PROMPTS:
            caches.append(spec.make_cache())
            model(mx.array([prompt]), cache=caches[-1])
        # every kind's merge of two rows copies them into new arrays, so each row's own cache then decodes
        # alone from the same prefill (one prefill a prompt, not two: a quantized model's costs seconds)
        batch = kinds.merge(caches)
        together = model(mx.array([[11], [11]]), cache=batch)[:, -1]
        alone = [_logprobs(model(mx.array([[11]]), cache=c)[0, -1]) for c in caches]
        drift = max(float(mx.max(_gap(_logprobs(together[i]), alone[i]))) for i in range(len(_PROMPTS)))
    except Exception as exc:  # the model's code refused batch caches
        _settle(model, spec)
        return f"its code fails on batch caches ({type(exc).__name__}: {str(exc)[:120]})"
    if not drift <= TOLERANCE:
        return f"its rows drift in a batch (logprobs {drift:.2g} from the same row alone)"
    return None


def rows_problem(model, spec) -> str | None:
    """Why ``model``'s code cannot decode a row-wise batch (``kinds.rows``) exactly, or None when it can.

    Two rows decode one token, then three in one step (a speculative step's width), each in its own
    buffers; the same tokens decoded by each row alone must give the same logprobs. Asked only of a
    model that batches (:func:`batch_problem`): one that computes with a layer's keys before attending
    fails on the row-wise keys, and merges instead."""
    from semantic import cpuattention

    if not cpuattention.installed():  # the process's attention is MLX's own, which takes no row-wise keys
        return "the process's attention is MLX's own (SEMANTIC_CPU_ATTENTION=off)"
    steps = ([11], [12, 13, 14])
    try:
        batch_rows, alone = [], []
        for prompt in _PROMPTS:
            together, single = spec.make_cache(), spec.make_cache()
            for c in (together, single):
                model(mx.array([prompt]), cache=c)
            batch_rows.append(together)
            alone.append([_logprobs(model(mx.array([step]), cache=single)[0]) for step in steps])
        batch = kinds.merge(batch_rows, rows=True)
        drift = 0.0
        for j, step in enumerate(steps):
            out = _logprobs(model(mx.array([step, step]), cache=batch))
            drift = max(drift, *(float(mx.max(_gap(out[i], alone[i][j]))) for i in range(len(_PROMPTS))))
    except Exception as exc:  # the model's code computes with the keys, or asks for a mask array
        _settle(model, spec)
        return f"its code fails on row-wise batch caches ({type(exc).__name__}: {str(exc)[:120]})"
    if not drift <= TOLERANCE:
        return f"its rows drift in a row-wise batch (logprobs {drift:.2g} from the same row alone)"
    return None


def _settle(model, spec) -> None:
    """A whole forward pass, evaluated here, after one that raised midway: what the model's code keeps
    between passes (gemma3n's) is left unevaluated by the pass that stopped, and MLX evaluates an array
    only on the thread that made it, so the executor's thread would fail on it at its first turn."""
    mx.eval(model(mx.array([_PROMPTS[0]]), cache=spec.make_cache()))


def _gap(a, b):
    return mx.where(a == b, 0.0, mx.abs(a - b))  # equal where both are -inf (a model that masks ids out)


def _logprobs(row):
    return row - mx.logsumexp(row, axis=-1, keepdims=True)


def replay_problem(model, spec) -> str | None:
    """Why ``model``'s recurrent layers cannot be replayed exactly (``semantic.decode.replay``), or None.

    Two rows feed three tokens, limited to 1 and 2 of them, and take the rest back out; their
    recurrent states and next token must then equal each row's own decode of exactly those tokens."""
    from semantic.decode import replay, rewind

    try:
        extra, alone, caches, singles = (31, 32, 33), [], [], []
        for prompt, n in zip(_PROMPTS, (1, 2)):
            c = spec.make_cache()
            model(mx.array([prompt]), cache=c)
            single = spec.make_cache()
            model(mx.array([prompt + extra[:n]]), cache=single)
            singles.append([compat.read_arrays(x) for x in replay.replaying(single)])  # copies, kept as they are
            alone.append(_logprobs(model(mx.array([[11]]), cache=single)[0, -1]))
            caches.append(c)
        batch = kinds.merge(caches)
        rewind.prepare(batch)
        replay.begin(batch, (1, 2))
        model(mx.array([extra, extra]), cache=batch)
        replay.end(batch)
        rewind.rewind(batch, (2, 1))
        # the states themselves: a tiny model's logprobs can hide a wrong one
        states = [(a, b) for row, single in enumerate(singles) for c, arrays in zip(replay.replaying(batch), single)
                  for a, b in zip(compat.read_arrays(c.extract(row)), arrays)]
        state_drift = max(float(mx.max(mx.abs(a - b)) / (mx.max(mx.abs(b)) + 1e-6)) for a, b in states)
        together = model(mx.array([[11], [11]]), cache=batch)[:, -1]
        drift = max(float(mx.max(_gap(_logprobs(together[i]), alone[i]))) for i in range(len(_PROMPTS)))
    except Exception as exc:  # the model's code refused row lengths
        _settle(model, spec)
        return f"its recurrent layers fail on row lengths ({type(exc).__name__}: {str(exc)[:120]})"
    if not (drift <= TOLERANCE and state_drift <= TOLERANCE):
        return (f"its recurrent layers ignore a row's length (state {state_drift:.2g} of its size, logprobs "
                f"{drift:.2g} from the same row alone): a rejected draft cannot be replayed exactly")
    return None
