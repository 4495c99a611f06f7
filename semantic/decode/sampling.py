"""Per-sequence sampling settings, turned into mlx-lm samplers and logits processors.

Each request in a batch keeps its own settings: mlx-lm's ``BatchGenerator``
takes one sampler and one list of logits processors per sequence, and calls
a sequence's own sampler on its row alone. A sampled sequence draws from its
own seed, re-seeded at every step from ``(seed, step)``, so the same seed
gives the same reply whatever else shares the batch. Greedy settings (the
default) return no sampler at all: the executor's argmax, exactly as a fresh
prefill decodes.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from semantic import compat
from semantic.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one sequence picks its tokens (OpenAI's names and ranges).

    ``top_p`` 1.0 and ``top_k`` 0 mean off; ``repetition_penalty`` 1.0 and
    the two additive penalties 0.0 mean off. ``seed`` None draws a random
    seed per request. ``top_logprobs`` asks for that many alternatives per
    generated token (0: none).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0

    def __post_init__(self):
        def bad(what: str, value) -> InvalidRequestError:
            return InvalidRequestError(f"{what}, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise bad(f"{name} must be a number", v)
        for name in ("top_k", "top_logprobs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(f"{name} must be an integer", v)
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature must be in [0, 2]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            raise bad("top_k must be >= 0 (0: off)", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p must be in [0, 1]", self.min_p)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty must be in (0, 10]", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2]", getattr(self, name))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed must be an integer", self.seed)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", self.top_logprobs)

    @property
    def greedy(self) -> bool:
        """Argmax over unmodified logits: exactly what a fresh prefill decodes."""
        return self.temperature == 0.0 and not self.penalized

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


GREEDY = SamplingParams()


def sampler_for(params: SamplingParams) -> Callable[[mx.array], mx.array] | None:
    """The sequence's own sampler, or None for the step loop's greedy argmax."""
    if params.temperature == 0.0:
        return None  # argmax, also after penalties
    inner = make_sampler(
        temp=params.temperature,
        top_p=params.top_p if params.top_p < 1.0 else 0.0,
        min_p=params.min_p,
        top_k=params.top_k,
    )
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    step = 0

    def sample(logprobs: mx.array) -> mx.array:
        # the worker thread is MLX's only caller: seeding the global key here
        # makes this row's draw depend on (seed, step) alone, not on the batch
        nonlocal step
        mx.random.seed((seed * 1_000_003 + step) % (1 << 63))
        step += 1
        return inner(logprobs)

    return sample


def processors_for(params: SamplingParams) -> list | None:
    """mlx-lm logits processors for the penalties, or None when none is set."""
    if not params.penalized:
        return None
    return compat.make_logits_processors(
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
