"""The step loop: continuous batching where a long prefill never stalls decoding.

mlx-lm's ``BatchGenerator`` prefills a newly inserted prompt before the
sequences already generating get their next token (0.30.4 whole, 0.32 in
2048-token steps by default), and it cannot batch quantized caches. This loop
is ours, built from mlx-lm's model call and cache classes, and behaves the
same under both mlx-lm versions. One :meth:`StepLoop.step`::

    decode    one forward pass: the last token of every generating sequence
              (B rows: global attention's each in its own buffers, kinds.rows,
              where the model's code takes them; else left-padded batch caches:
              BatchKVCache, BatchRotatingKVCache, batchquant.BatchQuantizedKVCache)
    prefill   then at most the step's budget of prompt tokens (``semantic.runner.stepbudget``:
              the largest chunk when nothing decodes, else a fixed chunk or
              what holds an inter-token latency target) of the waiting
              sequences, in order, each chunk its own forward pass over that
              sequence's single caches; a chunk also ends at the sequence's
              ``snapshot_at`` positions (``on_snapshot`` checkpoints the
              cache), and the step's prefill ends there unless its budget
              reaches the next stop; ``on_chunk`` sees the cache after every
              chunk (a sliding window's passed blocks are pooled there, before
              a one-token pass trims the ring)
    read      the decode step's tokens, and the first token of every prompt
              whose last chunk ran now: a short last chunk is one pass whose
              head computes only its last row (``lastrow``), a long one leaves
              its last token to a pass of its own, as mlx-lm does
    join      sequences that got their first token join the batch caches, so
              the next decode step includes them (their last chunk's
              ``on_chunk`` runs first, after the token was reported)

Speculation (``speculation``, a :class:`~semantic.decode.promptlookup.SpecConfig`; None:
off). A greedy sequence whose newest tokens occurred earlier in its
context drafts the tokens that followed them there (``semantic.decode.promptlookup``).
The decode step then feeds every row its next token plus its draft, padded
to the longest draft; row ``i``'s output at position ``j`` is the model's
token after its input ``j``, so a drafted token is accepted while it equals
the model's token before it, and the row emits the accepted drafts plus
the model's own next token, ending at a finish::

    inputs  row 0   n0  d1  d2  d3         outputs  t0  t1  t2  t3
            row 1   n1  .   .   .   (no draft)      u0  -   -   -
    d1 = t0, d2 = t1, d3 != t2:  row 0 emits t0 t1 t2 and keeps n0 d1 d2;  row 1 emits u0, keeps n1

The rejected inputs leave the caches (``semantic.decode.rewind``), so every
emitted token is the one a step of width 1 would have read: greedy output
does not change, only its pace. Recurrent layers cannot drop inputs: their
state from before the step is kept, and a row that accepted less than its
whole draft is put back and fed its accepted inputs again before the batch
is next used (``semantic.decode.replay``). Sampled, constrained and penalized rows
never draft (they decode at position 0 as always).

    time ─►  | decode B | chunk a[0:64) | decode B | chunk a[64:128) | ...
             a decoder waits one chunk per step, never the whole prefill

A token is reported as soon as it is read. A sequence that has finished
(a stop token, its length) leaves the batch in the step that read its last
token, as a :class:`Closed` whose caches hold the prompt and every generated
token but that last one, which was never fed (as in vLLM and mlx-lm's
server): feeding it would cost a whole decode step after the reply, and the
next turn waits behind that step, while its own prefill takes the one token
more at no visible cost. Sequences decode greedily unless they bring
a sampler; logits processors see the whole token history.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from semantic import compat, kinds
from semantic.decode import replay, rewind
from semantic.runner import lastrow
from semantic.runner.stepbudget import StepBudget
from semantic.decode.constraint import Constraint
from semantic.decode.promptlookup import Drafter, SpecConfig, batch_draft_len
from semantic.kinds.rows import APART_FROM_BYTES
from semantic.request import Request
from semantic.decode.sampling import processors_for, sampler_for

# on_snapshot(uid, caches, fed): the sequence's live caches after ``fed`` prompt tokens, at one of its snapshot positions
OnSnapshot = Callable[[int, list, int], None]
# on_chunk(uid, caches, start, end): the live caches right after the chunk of prompt tokens [start, end),
# every chunk before the prompt's last token
OnChunk = Callable[[int, list, int, int], None]


@dataclass(slots=True)
class Event:
    """One token read for one sequence; ``finish_reason`` is set on its last one."""

    uid: int
    token: int
    logprobs: mx.array          # the row over the vocabulary (natural log)
    finish_reason: str | None   # "stop" (a stop token), "length", or None


@dataclass(slots=True)
class Closed:
    """A finished sequence: per-layer caches of its first ``held`` tokens (the prompt and every generated
    token but the last)."""

    uid: int
    caches: list
    held: int


@dataclass(slots=True)
class _Seq:
    uid: int
    prompt: tuple[int, ...]        # the request's ids from ``fed`` on: what the caches do not hold yet
    caches: list                   # single caches while prefilling; None once in the batch
    max_tokens: int
    sampler: Callable | None
    processors: list | None
    history: list[int] | None      # every token fed or to feed: the processors' context (None without any)
    constraint: Constraint | None  # the grammar its tokens follow (None: free)
    snapshot_at: deque = field(default_factory=deque)
    on_snapshot: OnSnapshot | None = None
    on_chunk: OnChunk | None = None
    fed: int = 0                   # prompt tokens fed so far
    generated: int = 0
    next_token: int | None = None  # sampled, reported, not fed yet
    done: bool = False             # its last token was read: it leaves in this step
    ids: tuple = ()                # the request's whole history: a drafter's context
    drafter: Drafter | None = None # greedy and free sequences, once they decode with speculation on
    last_chunk: tuple[int, int] | None = None  # the prompt's last chunk: its on_chunk is due before it joins

    @property
    def can_draft(self) -> bool:
        return self.sampler is None and not self.processors and self.constraint is None


class StepLoop:
    """Chunked prefill between batched decode steps (see the module docstring)."""

    def __init__(self, model, *, stop_tokens: Sequence[int], max_batch: int, prefill_chunk: int | StepBudget,
                 speculation: SpecConfig | None = None, single: bool = False, rows: bool = False):
        """``prefill_chunk``: a step budget, or a fixed number of prompt tokens per step. ``single``: one
        sequence at a time, decoding on its own caches (a model whose caches or code do not batch).
        ``rows``: global attention's rows stay in their own buffers in the batch (``kinds.rows``; a model
        whose code takes them, ``batchprobe.rows_problem``), else they merge into one left-padded tensor."""
        assert max_batch > 0, max_batch
        assert not single or (max_batch == 1 and speculation is None), "one sequence, no drafts to rewind"
        self.single = single
        self.rows = rows
        self.budget = prefill_chunk if isinstance(prefill_chunk, StepBudget) else StepBudget(
            prefill_chunk, fixed=prefill_chunk)
        self.model = model
        self.speculation = speculation
        self.spec_steps = self.drafted = self.accepted = 0  # counters: wide steps, tokens drafted, accepted
        self.replays = self.replayed = 0  # counters: replay passes, and their width summed (recurrent layers)
        self._pending: replay.Pending | None = None  # the last speculative step's recurrent rows to put right
        self.stop_tokens = frozenset(stop_tokens)
        self.max_batch = max_batch
        self._waiting: deque[_Seq] = deque()   # prompts, in arrival order
        self._ready: list[_Seq] = []           # first token read; they join before the next decode
        self._rows: list[_Seq] = []            # the batch, row order of ``_batch``
        self._batch: list | None = None        # per-layer batch caches
        self._apart = False                    # whether they keep global attention's rows apart (kinds.rows)
        self._seqs: dict[int, _Seq] = {}

    # ------------------------------------------------------------ sequences

    def add(
        self, uid: int, request: Request, fed: int, caches: list, *,
        snapshot_at: Sequence[int] = (), on_snapshot: OnSnapshot | None = None, on_chunk: OnChunk | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """Queue ``request`` for prefill, then decoding; ``caches`` hold its first ``fed`` ids.

        The request's ``max_tokens`` and ``sampling`` are read here, as they
        are; ``snapshot_at`` are positions counted from ``fed`` where a chunk must
        end so that ``on_snapshot`` can see the cache there; ``on_chunk`` sees the
        cache right after every chunk before the prompt's last token (which is
        fed alone); ``constraint`` is the request's grammar over this model's
        vocabulary.
        """
        assert uid not in self._seqs, uid
        assert 0 <= fed < len(request.ids), (fed, len(request.ids))
        prompt = request.ids[fed:]
        assert all(0 < s < len(prompt) for s in snapshot_at), (snapshot_at, len(prompt))
        processors = processors_for(request.sampling)
        seq = _Seq(
            uid, prompt, caches, request.max_tokens, sampler_for(request.sampling), processors,
            list(request.ids) if processors else None, constraint, deque(sorted(set(snapshot_at))), on_snapshot,
            on_chunk, ids=request.ids,
        )
        self._seqs[uid] = seq
        self._waiting.append(seq)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, uid: int) -> bool:
        return uid in self._seqs

    def generated(self, uid: int) -> int:
        return self._seqs[uid].generated

    def caches(self, uid: int) -> list:
        """The exact caches of ``uid``'s tokens fed so far (rows of the batch are copied out)."""
        seq = self._seqs[uid]
        if seq.caches is not None:
            return seq.caches
        self._settle()
        row = self._rows.index(seq)
        return self._row(row)

    def held(self, uid: int) -> int:
        """How many tokens of ``uid``'s history and output its caches hold now."""
        seq = self._seqs[uid]
        if not seq.generated:
            return len(seq.ids) - len(seq.prompt) + seq.fed
        return len(seq.ids) + seq.generated - 1  # the newest token is fed by the next step, or never

    def finish(self, ends: Sequence[tuple[int, int | None]]) -> list[Closed]:
        """Take each ``(uid, generated)`` out after its ``generated``-th token (None: its newest: its last, or a
        stop string's; fewer when a speculative step read more), all in one pass over the batch; each one's
        caches hold every token before that one."""
        seqs = [self._seqs[uid] for uid, _ in ends]
        backs = {s.uid: s.generated - (s.generated if g is None else g) for s, (_, g) in zip(seqs, ends)}
        assert all(s.generated and 0 <= backs[s.uid] < s.generated for s in seqs), "remove() one still prefilling"
        if any(backs.values()):  # the tokens after them were read in the same step: their inputs leave the cache
            rewind.rewind(self._batch, [backs.get(s.uid, 0) for s in self._rows])
        for seq in seqs:
            if backs[seq.uid] and self._pending is not None:  # a recurrent state is replayed with fewer inputs
                self._pending.cut(seq, backs[seq.uid])
            seq.generated -= backs[seq.uid]
        if any(seq in self._rows for seq in seqs):
            self._settle()
        closed, rows = [], []
        for seq in seqs:
            held = self.held(seq.uid)
            if seq in self._rows:
                rows.append(self._rows.index(seq))
                caches = self._row(rows[-1])
            else:  # its first token, read in this step
                self._last_chunk_seen(seq)
                self._ready.remove(seq)
                caches, seq.caches = seq.caches, None
            del self._seqs[seq.uid]
            closed.append(Closed(seq.uid, caches, held))
        if rows:
            self._drop_rows(rows)  # one filter of the batch for all of them
        return closed

    def remove(self, uid: int) -> list | None:
        """Take ``uid`` out wherever it is; its :meth:`caches`, or None before its first token."""
        caches = self.caches(uid) if self._seqs[uid].generated else None
        self._settle()
        seq = self._seqs.pop(uid)
        if seq in self._rows:
            self._drop_rows([self._rows.index(seq)])
        elif seq in self._ready:
            self._last_chunk_seen(seq)
            self._ready.remove(seq)
        else:
            self._waiting.remove(seq)
        return caches

    # ------------------------------------------------------------ one step

    def step(self) -> list[Event]:
        """Decode one token for the batch, prefill one chunk; return the tokens read. A sequence whose
        event has a ``finish_reason`` stays until the caller takes it out with :meth:`finish` (at that
        token, or at an earlier one of the same step: a stop string)."""
        assert not any(s.done for s in [*self._rows, *self._ready]), "finish() every sequence that ended"
        started = time.perf_counter()
        self._settle()
        self._join()
        decoded = self._decode() if self._rows else None
        firsts, prefilled = self._prefill()
        events = self._read_decoded(*decoded) if decoded is not None else []
        for seq, token, logprobs in firsts:
            events.append(self._advance(seq, token, logprobs))
            self._ready.append(seq)
        self.budget.observe(time.perf_counter() - started, decoded is not None, prefilled)  # every token was read
        return events

    def _decode(self):
        """Queue the batch's forward pass: (tokens, logprobs) at position 0, and the speculative outputs or None."""
        for s in self._rows:
            if s.history is not None:
                s.history.append(s.next_token)  # fed by this forward pass: the processors' context
        drafts = self._drafts() if self.speculation else []
        width = 1 + max(map(len, drafts), default=0)
        # a row's unused positions repeat its token: computed, then always dropped
        inputs = [[s.next_token, *d, *[s.next_token] * (width - 1 - len(d))]
                  for s, d in zip(self._rows, drafts or [[]] * len(self._rows))]
        kept = None
        if width > 1:
            rewind.prepare(self._batch)
            kept = replay.begin(self._batch, [1 + len(d) for d in drafts])
        out = self.model(mx.array(inputs), cache=self._batch)
        if kept is not None:
            replay.end(self._batch)
        logits = out[:, 0, :] if width > 1 else out[:, -1, :]
        if any(s.constraint is not None for s in self._rows):
            mx.async_eval(logits)  # the forward pass runs while llguidance computes the rows' masks
        tokens, logprobs = self._sample(self._rows, logits)
        if width == 1:
            mx.async_eval(tokens, logprobs)  # the prefill chunk is queued behind it
            return tokens, logprobs, None
        ahead = out[:, 1:, :]
        ahead = ahead - mx.logsumexp(ahead, axis=-1, keepdims=True)
        ahead_tokens = mx.argmax(ahead, axis=-1)
        mx.async_eval(tokens, logprobs, ahead_tokens, ahead)
        self.spec_steps += 1
        return tokens, logprobs, (drafts, ahead_tokens, ahead, inputs, kept)

    def _drafts(self) -> list[list[int]]:
        """Each row's tokens bet to follow its next one, all cut to the length that pays for the batch."""
        guesses = [self._propose(s) for s in self._rows]
        k = batch_draft_len([(s.drafter.rate if g else 0.0, len(g)) for s, g in zip(self._rows, guesses)],
                            self.speculation.position_cost)
        return [g[:k] for g in guesses]

    def _propose(self, seq: _Seq) -> list[int]:
        if not seq.can_draft:
            return []
        if seq.drafter is None:  # built at its first decode step, not before its first token
            assert seq.generated == 1, seq.generated
            seq.drafter = Drafter((*seq.ids, seq.next_token), self.speculation)
        # all accepted, the step reads len(draft) + 1 tokens: no more than the budget leaves
        return seq.drafter.propose(seq.max_tokens - seq.generated - 1)

    def _prefill(self) -> tuple[list[tuple[_Seq, int, mx.array]], int]:
        """Feed up to the step's budget of prompt tokens; the sequences whose prompt is done, with their
        first token, and the tokens fed."""
        decoding = bool(self._rows)
        budget, done, fed = self.budget.tokens(decoding), [], 0
        room = self.max_batch - len(self._rows) - len(self._ready)
        for seq in list(self._waiting)[: max(room, 0)]:
            while budget > 0 and seq.fed < len(seq.prompt):
                end = min(len(seq.prompt), seq.fed + budget)
                at_snapshot = bool(seq.snapshot_at) and seq.snapshot_at[0] <= end
                if at_snapshot:
                    end = seq.snapshot_at.popleft()
                elif end == len(seq.prompt) and end - seq.fed > lastrow.ONE_PASS_TOKENS:
                    # a long last chunk leaves its last token alone, as mlx-lm's prefill does: a pass whose logits
                    # are never read skips the last layer's work after its K/V, which costs more than one
                    # token's pass there (a short one is one pass, its head on the last row: lastrow.py)
                    end -= 1
                chunk = mx.array([seq.prompt[seq.fed : end]])
                start = seq.fed
                budget -= end - seq.fed
                fed += end - seq.fed
                seq.fed = end
                if end < len(seq.prompt):
                    # only the caches are evaluated: MLX never computes this chunk's logits
                    self.model(chunk, cache=seq.caches)
                    mx.eval([compat.cache_arrays(c) for c in seq.caches])
                    mx.clear_cache()
                    if seq.on_chunk is not None:
                        seq.on_chunk(seq.uid, seq.caches, start, end)
                    if at_snapshot:
                        if seq.on_snapshot is not None:
                            seq.on_snapshot(seq.uid, seq.caches, end)
                        # go on only if the budget reaches the next stop (or the end): a few
                        # tokens more cost a whole forward pass and put later chunks off the grid
                        if budget < (seq.snapshot_at[0] if seq.snapshot_at else len(seq.prompt)) - end:
                            budget = 0
                else:
                    logits = lastrow.last_logits(self.model, chunk, seq.caches)
                    if end - start > 1:  # a one-token pass trimmed the ring: nothing passed is left to see
                        seq.last_chunk = (start, end)
            if seq.fed < len(seq.prompt):
                break  # the budget is spent
            token, logprobs = self._sample([seq], logits)
            mx.eval(token, logprobs, [compat.cache_arrays(c) for c in seq.caches])
            self._waiting.remove(seq)
            done.append((seq, int(token.item()), logprobs[0]))
            if not decoding:  # it decodes from the next step on: the rest of this one delays its second token
                decoding, budget = True, min(budget, self.budget.tokens(True))
        return done, fed

    def _sample(self, seqs: list[_Seq], logits: mx.array):
        if any(s.processors for s in seqs):
            rows = []
            for i, s in enumerate(seqs):
                row = logits[i : i + 1]
                if s.processors:
                    context = mx.array(s.history)
                    for p in s.processors:
                        row = p(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        if any(s.constraint is not None for s in seqs):
            logits = _constrain(seqs, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if any(s.sampler is not None for s in seqs):
            tokens = mx.concatenate(
                [s.sampler(logprobs[i : i + 1]) if s.sampler is not None
                 else mx.argmax(logprobs[i : i + 1], axis=-1)
                 for i, s in enumerate(seqs)]
            )
        else:
            tokens = mx.argmax(logprobs, axis=-1)
        return tokens, logprobs

    def _read_decoded(self, tokens: mx.array, logprobs: mx.array, spec) -> list[Event]:
        ids = tokens.tolist()
        if spec is not None:
            return self._read_speculative(ids, logprobs, *spec)
        return [self._advance(s, t, logprobs[row]) for row, (s, t) in enumerate(zip(self._rows, ids))]

    def _read_speculative(self, firsts: list[int], logprobs: mx.array, drafts, ahead_tokens, ahead, inputs,
                          kept) -> list[Event]:
        """Each row's accepted tokens as events; the rejected inputs leave the caches (recurrent ones: once
        the pending replay runs)."""
        width = 1 + ahead_tokens.shape[1]
        later = ahead_tokens.tolist()
        events, drops = [], []
        for row, (seq, draft) in enumerate(zip(self._rows, drafts)):
            token, row_logprobs, taken = firsts[row], logprobs[row], 0
            while True:
                event = self._advance(seq, token, row_logprobs)
                events.append(event)
                if event.finish_reason is not None or taken == len(draft) or draft[taken] != token:
                    break
                taken += 1  # the draft's token was the model's: its output is read too
                token, row_logprobs = later[row][taken - 1], ahead[row, taken - 1]
            if draft:
                seq.drafter.record(len(draft), taken)
                self.drafted += len(draft)
                self.accepted += taken
            drops.append(width - 1 - taken)
        rewind.rewind(self._batch, drops)
        if kept is not None:
            self._pending = replay.Pending(list(self._rows), kept, inputs, [1 + len(d) for d in drafts],
                                           [width - d for d in drops])
        return events

    def _advance(self, seq: _Seq, token: int, logprobs: mx.array) -> Event:
        seq.generated += 1
        seq.next_token = token
        if seq.drafter is not None:
            seq.drafter.extend((token,))
        done = seq.constraint is not None and seq.constraint.advance(token)  # the grammar is complete
        reason = "stop" if token in self.stop_tokens or done else "length" if seq.generated >= seq.max_tokens else None
        seq.done = reason is not None
        return Event(seq.uid, token, logprobs, reason)

    # ------------------------------------------------------------ the batch

    def _join(self) -> None:
        if not self._ready:
            return
        joining, self._ready = self._ready, []
        for s in joining:  # a batch cache keeps only the window: what the last chunk left is seen first
            self._last_chunk_seen(s)
        if self.single:  # the batch is the sequence's own caches (some kinds, or some models' code, do not batch)
            assert self._batch is None and len(joining) == 1
            self._batch, joining[0].caches = joining[0].caches, None
            self._rows += joining
            return
        apart = self.rows and (self._apart or any(_cache_bytes(s.caches) >= APART_FROM_BYTES for s in joining))
        if apart and self._batch is not None and not self._apart:
            # a long row joins short merged ones: they are copied out (short: cheap), and all kept apart
            self._settle()
            shorts = [self._row(i) for i in range(len(self._rows))]
            self._batch, self._rows, joining = None, [], [*self._rows, *joining]
            for s, caches in zip(joining, shorts):
                s.caches = caches
        merged = kinds.merge([s.caches for s in joining], apart)
        for s in joining:
            s.caches = None
        if self._batch is None:
            self._batch, self._apart = merged, apart
        else:
            for mine, theirs in zip(self._batch, merged):
                mine.extend(theirs)
        self._rows += joining

    @staticmethod
    def _last_chunk_seen(seq: _Seq) -> None:
        """``on_chunk`` for the prompt's last chunk, after its first token was reported."""
        if seq.on_chunk is not None and seq.last_chunk is not None:
            seq.on_chunk(seq.uid, seq.caches, *seq.last_chunk)
        seq.last_chunk = None

    def _settle(self) -> None:
        """Run the last speculative step's pending replay (recurrent rows that accepted part of a draft)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            width = pending.replay(self.model, self._batch, self._rows)
            self.replays += width > 0
            self.replayed += width

    def _row(self, row: int) -> list:
        """Row ``row``'s caches, copied out of the batch (a batch of one: the caches themselves)."""
        return list(self._batch) if self.single else [c.extract(row) for c in self._batch]

    def _drop_rows(self, rows: list[int]) -> None:
        gone = set(rows)
        keep = [i for i in range(len(self._rows)) if i not in gone]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._batch, self._apart = None, False
            return
        for c in self._batch:
            c.filter(keep)


def _cache_bytes(caches: list) -> int:
    """The bytes a sequence's single caches hold (their buffers, spare slots included)."""
    return sum(a.nbytes for c in caches for a in compat.cache_arrays(c))


def _constrain(seqs: list[_Seq], logits: mx.array) -> mx.array:
    """Mask each constrained row to the tokens its grammar allows; other rows stay exactly as they were."""
    allowed = np.ones(logits.shape, dtype=bool)
    for i, s in enumerate(seqs):
        if s.constraint is not None:
            allowed[i] = s.constraint.allowed()
    return mx.where(mx.array(allowed), logits, -mx.inf)
