"""How many prompt tokens one step of the loop prefills: a step budget, not a fixed chunk.

A step is one decode forward pass for the generating sequences, then
prefill chunks (``semantic.runner.steploop``). Its prompt tokens trade the
decoders' inter-token latency against the prompt's time to first token::

    nothing decodes         the largest chunk (``solo``): nobody waits, and each
                            forward pass has a fixed cost (the weights are read
                            once per pass), so fewer, larger passes finish sooner
    sequences decode        ``itl_target_s`` set: as many tokens as keep a step
                            within it, from what steps cost lately; unset: the
                            device's chunk (``defaults.prefill_chunk``)

A step's time is modelled as ``decode + per_token * n``: ``decode`` from
the steps that prefilled nothing, ``per_token`` from the others, both as
moving averages, so the budget follows the batch size and the context
length as they change. A ``fixed`` chunk turns all of this off.
"""

from __future__ import annotations

from dataclasses import dataclass

SOLO_CHUNK = 2048   # mlx-lm's own prefill step: its activations stay well within memory on every device
FLOOR = 16          # a prompt always advances, whatever the target
ALPHA = 0.3         # weight of the newest step in the moving averages


@dataclass(slots=True)
class StepBudget:
    """The prompt tokens of the next step (see the module docstring)."""

    decoding_chunk: int                 # while sequences decode, without a target
    itl_target_s: float | None = None   # while sequences decode: the step time to hold
    solo: int = SOLO_CHUNK
    fixed: int | None = None            # every step, decoding or not (the old fixed chunk)
    decode_s: float | None = None       # what a step without prefill costs lately
    per_token_s: float | None = None    # what one more prompt token adds to a step lately

    def __post_init__(self):
        assert self.decoding_chunk > 0 and self.solo > 0, (self.decoding_chunk, self.solo)
        assert self.fixed is None or self.fixed > 0, self.fixed
        assert self.itl_target_s is None or self.itl_target_s > 0, self.itl_target_s

    def tokens(self, decoding: bool) -> int:
        if self.fixed is not None:
            return self.fixed
        if not decoding:
            return self.solo
        if self.itl_target_s is None:
            return self.decoding_chunk
        if self.decode_s is None or self.per_token_s is None:
            return min(self.decoding_chunk, self.solo)  # until both costs were seen
        room = (self.itl_target_s - self.decode_s) / max(self.per_token_s, 1e-9)
        return int(max(FLOOR, min(self.solo, room)))

    def observe(self, seconds: float, decoded: bool, prefilled: int) -> None:
        """Learn from one step that took ``seconds``: decoded or not, ``prefilled`` prompt tokens."""
        if not decoded:
            return  # a prefill-only step: its cost per token includes no decode to subtract
        if prefilled == 0:
            self.decode_s = _mix(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.per_token_s = _mix(self.per_token_s, max(seconds - self.decode_s, 0.0) / prefilled)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
