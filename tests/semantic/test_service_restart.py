"""Every turn type resumes after a restart where it resumed in RAM, with the history re-rendered.

Tiny random-weight models with recurrent layers (LFM2, Qwen3-Next) and a window shorter than a
block (gpt-oss, window 128 under 256-token blocks; gemma3_text, window 8): their caches resume only
where a snapshot was kept. A window of a block or more (gemma3_text's 8 under blocks of 4, as Gemma 3's 512 under 256) keeps
only the end of each history in its agent's file. A global model (llama) for comparison. The client trims each reply before sending it back, so no turn ends where the server's
cache did (a template that renders the reply otherwise does the same). An agent makes four turns,
regenerates, edits its last message, a second agent shares the system prompt, and the agent
regenerates turn four; then the service closes with every save done (a restart) or stays up, and
one more turn of each type runs: an append, a regenerate, an edit of the last message, a new
agent on the system prompt. Each reuses as many tokens from disk as from RAM, and its reply is
the one a fresh prefill gives. A window of a block or more is kept at the block boundary before a
message's start (the pool keeps every one, so RAM may resume a few tokens further, inside the next
message's role header). An edit that keeps the start of the last message resumes after a
restart at least where that message starts (in RAM, perhaps further: the pool's grid stops and a
window's block boundaries inside the message are not saved).
"""

from __future__ import annotations

import shutil

import mlx_lm
import pytest

from harness.models.zoo import write_tiny
from semantic.service import Service, TurnRequest
from tests.cache_helpers import check

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 6}


def _user(i: int, extra: str = "") -> dict:
    return {"role": "user", "content": f"step {i}: read file_{i}.py and say what it does " * 2 + extra}


def _open(model_dir, cache_dir) -> Service:
    return Service.open(str(model_dir), cache_dir=str(cache_dir), pool_bytes=64 << 20, disk_budget_bytes=1 << 30,
                        echo_history=False, block_tokens=BLOCKS.get(model_dir.parent.name.rstrip("0123456789"), 256))


def _turn(service: Service, agent: str, messages: list[dict]):
    prepared = service.prepare(TurnRequest(messages=messages, agent=agent, max_tokens=8))
    done = service.submit(prepared.request).result(120)
    text = service.tokenizer.decode([t for t in done.token_ids if t not in service.eos])
    service.remember(prepared, done, text, [])
    assert service.wait_saved(prepared.request.agent_id, 60)
    return done, text[:-2]  # the client sends the reply back trimmed: re-rendered, it differs


def _history(service: Service) -> tuple[list[dict], list[dict]]:
    msgs = [SYSTEM]
    for i in range(4):
        msgs.append(_user(i))
        _, reply = _turn(service, "a", msgs)
        msgs.append({"role": "assistant", "content": reply})
    prompt4 = msgs[:-1]
    _turn(service, "a", prompt4)                                  # a regenerate
    _turn(service, "a", prompt4[:-1] + [_user(3, "and fix it")])  # an edit of the last message
    _turn(service, "b", [SYSTEM, _user(9)])                       # a second agent
    _, reply = _turn(service, "a", prompt4)                       # turn four regenerated again
    return prompt4 + [{"role": "assistant", "content": reply}], prompt4


NEXT = {
    "append": lambda msgs, prompt4: ("a", msgs + [_user(5)]),
    "regenerate": lambda msgs, prompt4: ("a", prompt4),
    "edit": lambda msgs, prompt4: ("a", prompt4[:-1] + [{"role": "user", "content": "Rather, list the files."}]),
    # an edit that keeps the start of the message: RAM may resume inside it (a grid stop, a window's block
    # boundary), which only the pool keeps; after a restart it resumes at least where the message starts
    "edit keeping its start": lambda msgs, prompt4: ("a", prompt4[:-1] + [_user(3, "differently")]),
    "new agent": lambda msgs, prompt4: ("c", [SYSTEM, _user(7)]),
}


# block tokens: a window of a block or more (gemma3_text's 8 under blocks of 4, as Gemma 3's 512 under 256) keeps only each history's end
# in its agent's file; its system prompt is saved as an entry of its own
BT_WINDOW = 4
BLOCKS = {"gemma3_text-window": BT_WINDOW}


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next", "gpt_oss", "llama", "gemma3_text", "gemma3_text-window"])
def model_dir(request, tmp_path_factory):
    return write_tiny(request.param.split("-")[0], tmp_path_factory.mktemp(request.param) / "model")


@pytest.fixture(scope="module")
def ref_model(model_dir):
    """The same weights loaded apart from every service, for mlx-lm's own generation (the references)."""
    return mlx_lm.load(str(model_dir))[0]


def test_every_turn_type_reuses_after_a_restart_what_it_reused_in_ram_and_replies_as_a_fresh_prefill(
        model_dir, ref_model, tmp_path):
    built = tmp_path / "built"
    service = _open(model_dir, built)
    msgs, prompt4 = _history(service)
    service.close(60)
    fresh = _open(model_dir, tmp_path / "fresh")
    edited_at = 0
    try:
        for kind, make in NEXT.items():
            agent, messages = make(msgs, prompt4)
            got = {}
            for mode in ("ram", "restart"):
                where = tmp_path / f"{kind}-{mode}"
                shutil.copytree(built, where)
                if mode == "ram":  # the history again in a live service: the pool holds what it made
                    shutil.rmtree(where)
                    live = _open(model_dir, where)
                    _history(live)
                else:
                    live = _open(model_dir, where)
                got[mode], _ = _turn(live, agent, messages)
                live.close(60)
            ref, _ = _turn(fresh, f"fresh-{kind}", messages)
            if kind == "edit keeping its start":
                assert got["ram"].cached_tokens >= got["restart"].cached_tokens >= edited_at > 0
            elif kind in ("edit", "new agent") and "window" in model_dir.parent.name:
                # the window is kept at the block boundary before the message's start (the system prompt's end);
                # RAM may resume at one inside the next message's role header, which the new history keeps too
                marks = fresh.prepare(TurnRequest(messages=prompt4, agent="probe")).request.boundaries
                at = (max(marks) if kind == "edit" else min(marks)) // BT_WINDOW * BT_WINDOW
                assert got["ram"].cached_tokens >= got["restart"].cached_tokens == at > 0
            else:
                assert got["restart"].cached_tokens == got["ram"].cached_tokens > 0, kind
            edited_at = got["restart"].cached_tokens if kind == "edit" else edited_at
            spec = fresh.scheduler.executor.spec
            for mode in ("ram", "restart"):
                assert got[mode].token_ids == ref.token_ids, (kind, mode)
                check(ref_model, got[mode], spec=spec, what=f"{kind} {mode}")
            check(ref_model, ref, spec=spec, what=f"{kind} fresh")
    finally:
        fresh.close(60)
