"""mlx-lm's ``BatchGenerator`` as a measured baseline, driven as our engine once drove it.

The step loop replaced it in the engine. EXP-010 measures it against that
loop, the throughput kind decodes with it, and tests check that a rebuilt
cache continues in it as in a fresh prefill. Its API differs between the
mlx-lm versions this project supports, detected by feature, not by version
string:

    |                          | 0.30.4                       | 0.32.x                         |
    |--------------------------|------------------------------|--------------------------------|
    | BatchGenerator.next()    | list of responses            | (prompt, generation) responses |
    | stop_tokens              | set of ids                   | sequences of id sequences      |
    | in-flight cache          | active_batch.extract_cache   | BatchGenerator.extract_cache   |
    | penalties' token context | the prompt prefilled now     | insert(all_tokens=...)         |

Callers see :class:`GenResponse`, the same under both versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

# Imported for its 0.30.4 backports, which fix the batch caches this generator extracts and attends over.
from semantic import compat  # noqa: F401

# 0.32 splits prompt-processing responses from generation responses.
HAS_NEXT_GENERATED = hasattr(BatchGenerator, "next_generated")


@dataclass(slots=True)
class GenResponse:
    """One generated token of one sequence, as both versions report it."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    cache: list | None  # the sequence's per-layer caches once it has finished


def make_batch_generator(
    model,
    *,
    max_tokens: int,
    stop_tokens: Iterable[int],
    completion_batch_size: int = 32,
    prefill_batch_size: int = 8,
    prefill_step_size: int = 2048,
    sampler=None,
) -> BatchGenerator:
    """A greedy (unless ``sampler``) BatchGenerator stopping on single-id tokens."""
    stops = sorted({int(t) for t in stop_tokens})
    kw = dict(
        max_tokens=max_tokens,
        completion_batch_size=completion_batch_size,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
        sampler=sampler,
    )
    if HAS_NEXT_GENERATED:
        return BatchGenerator(model, stop_tokens=[[t] for t in stops], **kw)
    return BatchGenerator(model, stop_tokens=set(stops), **kw)


def insert(
    gen: BatchGenerator,
    prompts: Sequence[Sequence[int]],
    caches: Sequence[list | None],
    max_tokens: Sequence[int],
    *,
    samplers: Sequence | None = None,
    processors: Sequence[list | None] | None = None,
    done: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Queue prompts (token ids) with optional per-prompt caches; returns uids.

    ``samplers`` and ``processors`` are per prompt (None: the generator's
    greedy / none). ``done`` is what each injected cache already holds: under
    0.32 it seeds the penalties' token context; 0.30.4 has no such input, so
    its penalties see only the prompt prefilled now.
    """
    kw = {}
    if samplers is not None and any(s is not None for s in samplers):
        kw["samplers"] = list(samplers)
    if processors is not None and any(processors):
        kw["logits_processors"] = [list(p or ()) for p in processors]
        if HAS_NEXT_GENERATED and done is not None:
            kw["all_tokens"] = [list(map(int, d)) for d in done]
    return list(
        gen.insert([list(map(int, p)) for p in prompts], max_tokens=list(max_tokens), caches=list(caches), **kw)
    )


def remove(gen: BatchGenerator, uid: int) -> None:
    """Take a sequence out of the generator wherever it is (queued, prefilling, decoding)."""
    gen.remove([uid])


def next_responses(gen: BatchGenerator) -> list[GenResponse]:
    """Advance one decode step; an empty list means nothing is left to do."""
    raw = gen.next_generated() if HAS_NEXT_GENERATED else gen.next()
    return [
        GenResponse(
            int(r.uid),
            int(r.token),
            r.logprobs,
            r.finish_reason,
            list(r.prompt_cache) if r.finish_reason is not None else None,
        )
        for r in raw
    ]


def extract_in_flight(gen: BatchGenerator, uid: int) -> list | None:
    """Per-layer caches of a sequence still in the generator, or None if unknown.

    Like a finished cache, it covers the prompt and every token reported so
    far (see :func:`finished_cache_tokens`).
    """
    if HAS_NEXT_GENERATED:
        found = gen.extract_cache([uid])
        return list(found[uid][0]) if uid in found else None
    batch = gen.active_batch
    if batch is not None and uid in batch.uids:
        return list(batch.extract_cache(batch.uids.index(uid)))
    for entry in gen.unprocessed_prompts:
        if entry[0] == uid:
            return list(entry[3])
    return None


def finished_cache_tokens(prompt_len: int, generated: int) -> int:
    """How many tokens a finished sequence's cache holds.

    Under both versions the decode loop feeds a sampled token to the model
    before it reports it, so a finished cache already covers the prompt and
    every generated token, the last one included. tests/harness/test_baseline.py
    pins this under each version.
    """
    return prompt_len + generated
