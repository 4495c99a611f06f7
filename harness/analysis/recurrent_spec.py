"""Speculation on recurrent layers (``semantic.decode.replay``): what it costs and whether it stays exact.

``python -m harness.analysis.recurrent_spec [--turns 1000] [--pairs 6 4] [--reply 48]``  (``make spec-recurrent``)

A random-weight model does not echo its context, so an edit-style reply (a stretch of the context
returned with one change) cannot be provoked from it. Each turn is therefore run twice on the same
prompt, interleaved: first without speculation, which gives the model's own greedy reply ``R``; then
with it, the prompt-lookup drafter's context also holding ``R`` with one token changed (the "file" the
reply copies; the model never sees it). The drafter, the batch, the verification and the replay are the
real ones, so acceptance follows prompt lookup over an edited copy: whole drafts taken up to the change,
one refused there, none until its n-gram is found again. What it gives:

    cost     two hybrids (random float32), 512-token context: a decode step, a verify step of 1 + k
             tokens, and a replay of r tokens (put back + fed again); LFM2-350M's geometry
             (``harness/trials/hybrid/model.py``: short convolutions) and a Qwen3-Next-like one
             (:data:`QWEN3_NEXT_SMALL`: Gated DeltaNet, MoE)
    turns    each, batch 1, ``--pairs`` edit-style turns of ``--reply`` tokens: time with
             speculation / without, acceptance rate, the share of the speculated turn spent replaying
    exact    ``--turns`` turns on each tiny hybrid (lfm2, qwen3_next), 4 rows a batch: tokens that differ
             from the same turn without speculation, and the largest logprob gap

Every timed region ends in ``mx.eval``; medians, A B A B order. Writes ``results/recurrent_spec.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 512
# loop counters summed over turns; drafts_*: speculative rows that took their whole draft, part of it, none
TOTALS = ("drafted", "accepted", "steps", "replays", "replayed", "drafts_whole", "drafts_part", "drafts_none")
# Qwen3-Next-80B-A3B's layer widths (hidden 2048; Gated DeltaNet with 32 value / 16 key heads of 128, conv 4;
# attention every 4th layer, 16 heads of 256, 2 KV heads) at 8 layers and 16 experts (4 active): 886M
# parameters, what this CPU holds in float32; its vocabulary is SmolLM2's, as the LFM2 geometry's
QWEN3_NEXT_SMALL = dict(
    model_type="qwen3_next", hidden_size=2048, num_hidden_layers=8, intermediate_size=5120, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1,
    shared_expert_intermediate_size=512, mlp_only_layers=[], moe_intermediate_size=512, rms_norm_eps=1e-6,
    vocab_size=49152, rope_theta=10000000.0, partial_rotary_factor=0.25, max_position_embeddings=262144,
    full_attention_interval=4, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)

    from semantic import blas

    blas.enable()  # before MLX is first imported
    from harness import environment

    doc = {"goal": "edit-style turn at batch 1: time with speculation <= 0.6x without; 0 text differences",
           "how": "drafts from prompt lookup over the model's own reply with one token changed (see the module doc)",
           "machine": {"nproc": os.cpu_count(), **{k: v for k, v in environment.machine_info().items()
                                                   if k in ("processor", "ram_gb", "system", "release")}},
           "packages": environment.packages(), "git": environment.git_info(ROOT)}
    doc["models"] = {}
    for (name, config), pairs in zip((("lfm2-350m", _lfm2_config()), ("qwen3-next-small", QWEN3_NEXT_SMALL)),
                                     args.pairs):
        model = _random_model(config)
        cost = _costs(model, args.rounds)
        print(f"{name} cost (ms):", json.dumps(cost))
        turns = _timed_turns(model, pairs, args.reply)
        print(f"{name} turns:", json.dumps({k: v for k, v in turns.items() if k != "pairs"}))
        doc["models"][name] = {"cost_ms": cost, "turns": turns}
        del model
    doc["exact"] = {name: _exact_turns(name, args.turns) for name in ("lfm2", "qwen3_next")}
    print("exact:", json.dumps(doc["exact"]))
    doc["differences"] = (sum(e["differing_turns"] for e in doc["exact"].values())
                          + sum(m["turns"]["differing_turns"] for m in doc["models"].values()))
    lfm2 = doc["models"]["lfm2-350m"]["turns"]
    doc["ratio"], doc["acceptance"] = lfm2["ratio_median"], lfm2["acceptance"]  # the goal's model
    doc["verdict"] = "PASS" if doc["ratio"] <= 0.6 and doc["differences"] == 0 else "FAIL"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"ratio {doc['ratio']:.2f}, acceptance {doc['acceptance']:.2f}, "
          f"{doc['differences']} differences: {doc['verdict']} -> {args.out}")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=1000, help="speculated turns per tiny model for exactness")
    ap.add_argument("--pairs", type=int, nargs=2, default=[6, 4],
                    help="timed turn pairs on LFM2-350M's geometry and on the Qwen3-Next-like one")
    ap.add_argument("--reply", type=int, default=48, help="tokens per timed reply")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "recurrent_spec.json")
    return ap.parse_args(argv)


def _lfm2_config() -> dict:
    from harness.trials.hybrid.model import GEOMETRIES

    return dict(GEOMETRIES["lfm2-350m"])


def _random_model(config: dict):
    """A model of ``config`` with N(0, 0.02²) float32 matrices, as EXP-018 builds its own (no files)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.02 if v.ndim >= 2 else v)
                                 for k, v in tree_flatten(model.parameters())]))
    mx.eval(model.parameters())
    return model


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab - 1, n)]


# ---------------------------------------------------------------- cost of one step


def _costs(model, rounds: int) -> dict:
    """Median ms of a decode step, a verify step of width 1 + k, and a replay of r tokens, A B A B."""
    import mlx.core as mx

    from semantic import ModelCacheSpec, compat, kinds
    from semantic.decode import replay, rewind

    spec = ModelCacheSpec.from_model(model)
    single = spec.make_cache()
    model(mx.array([_ids(1, CONTEXT, 49152)]), cache=single)
    batch = kinds.merge([single])
    mx.eval([compat.cache_arrays(c) for c in batch])

    def decode():
        out = model(mx.array([[5]]), cache=batch)
        mx.eval(mx.argmax(out[:, -1], -1), [compat.cache_arrays(c) for c in batch])
        rewind.rewind(batch, [1])  # positional only: the state moves on, which costs the same

    def verify(width):
        def run():
            rewind.prepare(batch)
            kept = replay.begin(batch, [width])
            out = model(mx.array([[5] * width]), cache=batch)
            replay.end(batch)
            mx.eval(mx.argmax(out, -1), [compat.cache_arrays(c) for c in batch])
            rewind.rewind(batch, [width])
            return kept
        return run

    def replayed(r, width=9):
        def run():  # a verify step whose row kept r inputs, then its replay (timed alone)
            rewind.prepare(batch)
            kept = replay.begin(batch, [width])
            model(mx.array([[5] * width]), cache=batch)
            replay.end(batch)
            mx.eval([compat.cache_arrays(c) for c in batch])
            rewind.rewind(batch, [width - r])
            pending = replay.Pending([0], kept, [[5] * width], [width], [r])
            start = time.perf_counter()
            pending.replay(model, batch, [0])
            took = time.perf_counter() - start
            rewind.rewind(batch, [r])
            return took
        return run

    names = ["decode", "verify_3", "verify_5", "verify_9", "replay_1", "replay_4"]
    fns = [decode, verify(3), verify(5), verify(9)]
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds + 1):
        for n, fn in zip(names, fns):
            start = time.perf_counter()
            fn()
            times[n].append(time.perf_counter() - start)
        for n, r in (("replay_1", 1), ("replay_4", 4)):
            times[n].append(replayed(r)())
    return {n: round(1000 * float(np.median(t[1:])), 1) for n, t in times.items()}  # the first is warm-up


# ---------------------------------------------------------------- edit-style turns


def _seeded(docs: dict[tuple, list[int]]):
    """A Drafter class whose context also holds the document its sequence edits (keyed by the prompt's first
    tokens): prompt lookup then drafts from that copy, as it would from a file in a real agent's context."""
    from semantic.decode.promptlookup import Drafter

    class Seeded(Drafter):
        __slots__ = ()

        def __init__(self, tokens, config):
            tokens = list(tokens)
            super().__init__(docs.get(tuple(tokens[:16]), []) + tokens, config)

    return Seeded


def _edited(reply: list[int], vocab: int, seed: int) -> list[int]:
    """``reply`` with one token changed, at a place drawn from ``seed`` (past its first few tokens)."""
    at = int(np.random.default_rng(seed).integers(3, len(reply) - 1))
    return reply[:at] + [(reply[at] + 1) % (vocab - 3) + 3] + reply[at + 1 :]


def _run(model, prompts: list[list[int]], n: int, speculation, docs=None):
    """One batch of turns: (completions in prompt order, seconds from the first token read to the last (the
    prefill, alike in both, is left out), loop counters, seconds spent replaying)."""
    from semantic import BatchExecutor, BlockPool, ModelCacheSpec, Request
    from semantic.decode import replay
    from semantic.runner import steploop

    spec = ModelCacheSpec.from_model(model)
    ended = []
    executor = BatchExecutor(model, _Tokenizer(), BlockPool(spec, 64 + 8 * sum(map(len, prompts)) // 16,
                                                          block_tokens=16),
                           spec, stop_tokens=[], max_batch=len(prompts), speculation=speculation,
                           on_ended=ended.append)
    assert speculation is None or executor.speculation_off is None, executor.speculation_off
    real_drafter, real_replay, real_init = steploop.Drafter, replay.Pending.replay, replay.Pending.__init__
    spent = [0.0]
    outcomes = {"whole": 0, "part": 0, "none": 0}

    def counted(self, rows, kept, inputs, fed, keeps):
        for f, k in zip(fed, keeps):
            if f > 1:
                outcomes["whole" if k == f else "none" if k == 1 else "part"] += 1
        real_init(self, rows, kept, inputs, fed, keeps)

    def timed_replay(self, *a):
        start = time.perf_counter()
        try:
            return real_replay(self, *a)
        finally:
            spent[0] += time.perf_counter() - start

    steploop.Drafter, replay.Pending.replay, replay.Pending.__init__ = _seeded(docs or {}), timed_replay, counted
    try:
        uids = [executor.submit(Request(f"a{i}", p, n), None, share=False) for i, p in enumerate(prompts)]
        done = {c.uid: c for c in executor.step()}
        took = max(c.finished_at for c in ended) - min(c.first_token_at for c in ended)
    finally:
        steploop.Drafter, replay.Pending.replay, replay.Pending.__init__ = real_drafter, real_replay, real_init
    loop = executor._loop
    counters = {"steps": loop.spec_steps, "drafted": loop.drafted, "accepted": loop.accepted,
                "replays": loop.replays, "replayed": loop.replayed, **{f"drafts_{k}": v for k, v in outcomes.items()}}
    return [done[u] for u in uids], took, counters, spent[0]


class _Tokenizer:
    """What the engine reads of a tokenizer: its stop ids (none here) and a decode for completions."""

    eos_token_ids = ()

    def decode(self, ids):
        return " ".join(map(str, ids))


def _timed_turns(model, pairs: int, reply: int) -> dict:
    from semantic.decode.promptlookup import SpecConfig

    vocab = 49152
    rows, totals = [], dict.fromkeys(TOTALS, 0)
    differing = 0
    for i in range(pairs):
        prompt = _ids(100 + i, CONTEXT, vocab)
        [plain], t_plain, _, _ = _run(model, [prompt], reply, None)
        doc = _edited(plain.token_ids, vocab, i)
        [spec], t_spec, counters, t_replay = _run(model, [prompt], reply, SpecConfig(), {tuple(prompt[:16]): doc})
        differing += spec.token_ids != plain.token_ids
        for k in totals:
            totals[k] += counters[k]
        rows.append({"plain_s": round(t_plain, 3), "spec_s": round(t_spec, 3), "replay_s": round(t_replay, 3),
                     "ratio": round(t_spec / t_plain, 3), **counters})
        print(f"  pair {i}: {t_plain:.2f} s plain, {t_spec:.2f} s speculated ({t_replay:.2f} s replaying), "
              f"{counters['accepted']}/{counters['drafted']} accepted in {counters['steps']} wide steps")
    ratios = [r["ratio"] for r in rows]
    return {"pairs": rows, "reply_tokens": reply, "context_tokens": CONTEXT, "ratio_median": float(np.median(ratios)),
            "ratio_max": max(ratios), "acceptance": totals["accepted"] / max(totals["drafted"], 1),
            "replay_share": sum(r["replay_s"] for r in rows) / sum(r["spec_s"] for r in rows),
            "tokens_per_wide_step": (totals["accepted"] + totals["steps"]) / max(totals["steps"], 1),
            "differing_turns": differing, **totals}


# ---------------------------------------------------------------- exactness over many turns


def _exact_turns(name: str, turns: int, rows: int = 4, reply: int = 16) -> dict:
    from harness.models import tiny
    from semantic.decode.promptlookup import SpecConfig

    model = {"lfm2": tiny.tiny_lfm2, "qwen3_next": tiny.tiny_qwen3_next}[name]()
    vocab = tiny.VOCAB
    differing = tokens = 0
    gap = 0.0
    totals = dict.fromkeys(TOTALS, 0)
    for b in range(0, turns, rows):
        prompts = [_ids(10_000 * b + r, 20 + 7 * r, vocab - 1) for r in range(rows)]
        plain, _, _, _ = _run(model, prompts, reply, None)
        docs = {tuple(p[:16]): _edited(c.token_ids, vocab - 1, b + r) for r, (p, c) in enumerate(zip(prompts, plain))}
        spec, _, counters, _ = _run(model, prompts, reply, SpecConfig(max_draft=4), docs)
        for s, p in zip(spec, plain):
            differing += s.token_ids != p.token_ids
            tokens += len(s.token_ids)
            gap = max(gap, float(np.max(np.abs(np.array(s.logprobs) - p.logprobs))))
        for k in totals:
            totals[k] += counters[k]
    return {"turns": turns, "rows_per_batch": rows, "reply_tokens": reply, "differing_turns": differing,
            "max_logprob_gap": gap, "acceptance": totals["accepted"] / max(totals["drafted"], 1), **totals}


if __name__ == "__main__":
    main()
