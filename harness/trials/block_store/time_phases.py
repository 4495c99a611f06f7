"""EXP-017's timings, both layouts in one run and interleaved rep by rep: the TTFT of a turn resumed from
disk after a restart, and a fully cached turn right after another agent's turn (whose save then runs)
against the same turn with nothing being saved."""

from __future__ import annotations

from harness.prompts import question, system_prompt, user_history
from harness.servers.client import stream_turn
from harness.trials.block_store.servers import LayoutServer, wait_idle

RESTART_USERS = {"short": 20, "long": 21}   # distinct histories: no block of one is a block of the other
FOREGROUND_USER, SAVER_USER = 300, 301
WARM_UP = [{"role": "user", "content": "Say hello."}]


def _restart_history(tok, size: str, tokens: int) -> list[dict]:
    user = RESTART_USERS[size]
    return [*user_history(tok, user, tokens - 40), question(tok, user, 1, 30)]


def restart_ttft(servers: list[LayoutServer], p: dict, tok) -> dict:
    """Per server, a ``restart_short_tokens`` and a ``restart_long_tokens`` agent take a first turn (saved:
    ``--sync-saves``). Then ``restart_reps`` times, each layout in turn (the order alternating by rep): SIGTERM
    its server, drop its cache files from the page cache, start it on the same directory, and time the
    client TTFT of each agent's next turn, which resumes from disk."""
    sizes = {"short": p["restart_short_tokens"], "long": p["restart_long_tokens"]}
    hist = {(s.layout, k): _restart_history(tok, k, n) for s in servers for k, n in sizes.items()}
    last: dict = {}
    for s in servers:
        for k in sizes:
            t = stream_turn(s.client, s.model_id, hist[s.layout, k], p["max_tokens"], agent=f"restart-{k}")
            _extend(hist[s.layout, k], t.text, tok, k, 2)
            last[s.layout, k] = t
    rows = []
    for rep in range(p["restart_reps"]):
        for s in servers if rep % 2 == 0 else servers[::-1]:
            start_s = s.restart(p["evict_page_cache"])
            if p["warm_after_restart"]:  # the process's first forward pass is no part of a load
                stream_turn(s.client, s.model_id, WARM_UP, 1, fresh=True)
            for k in sizes if rep % 2 == 0 else list(sizes)[::-1]:
                t = stream_turn(s.client, s.model_id, hist[s.layout, k], p["max_tokens"], agent=f"restart-{k}")
                prev = last[s.layout, k]
                rows.append(t.row(layout=s.layout, size=k, rep=rep, start_s=start_s,
                                  prev_total_tokens=prev.prompt_tokens + prev.completion_tokens,
                                  prev_prompt_tokens=prev.prompt_tokens))
                _extend(hist[s.layout, k], t.text, tok, k, rep + 3)
                last[s.layout, k] = t
    return {"sizes": sizes, "rows": rows}


def _extend(history: list[dict], reply: str, tok, size: str, turn: int) -> None:
    history += [{"role": "assistant", "content": reply}, question(tok, RESTART_USERS[size], turn, 20)]


def beside_save(servers: list[LayoutServer], p: dict, tok) -> dict:
    """Agents A and B share a ``fg_tokens`` system prompt. A's request is fixed (the prompt, a question,
    A's reply and one short message): sent again it is fully cached. Per rep and layout (the order
    alternating by rep), on servers without ``--sync-saves``: A's turn on an idle server (*quiet*); then
    B's turn, one more question, whose save runs behind its reply; then at once A's turn again
    (*beside*). ``written_during_beside``: the bytes the server wrote while A's beside turn ran."""
    system = system_prompt(tok, p["fg_tokens"])
    a_req, b_msgs = {}, {}
    for s in servers:
        a = [system, question(tok, FOREGROUND_USER, 1, 30)]
        t = stream_turn(s.client, s.model_id, a, p["fg_max_tokens"], agent="fg-a")   # the cold prefill
        a_req[s.layout] = [*a, {"role": "assistant", "content": t.text}, question(tok, FOREGROUND_USER, 2, 20)]
        stream_turn(s.client, s.model_id, a_req[s.layout], p["fg_max_tokens"], agent="fg-a")  # now cached
        b_msgs[s.layout] = [system, question(tok, SAVER_USER, 1, 30)]
        t = stream_turn(s.client, s.model_id, b_msgs[s.layout], p["fg_max_tokens"], agent="fg-b")
        b_msgs[s.layout].append({"role": "assistant", "content": t.text})
    rows = []
    for rep in range(p["fg_reps"]):
        for s in servers if rep % 2 == 0 else servers[::-1]:
            rows.append(_beside_rep(s, servers, a_req[s.layout], b_msgs[s.layout], rep, p, tok))
    return {"rows": rows}


def _beside_rep(s: LayoutServer, servers, a_req: list[dict], b_msgs: list[dict], rep: int, p: dict, tok) -> dict:
    wait_idle(servers, p["settle_s"], p["settle_max_s"])
    quiet = stream_turn(s.client, s.model_id, a_req, p["fg_max_tokens"], agent="fg-a")
    wait_idle(servers, p["settle_s"], p["settle_max_s"])
    b_msgs.append(question(tok, SAVER_USER, rep + 2, 20))
    b = stream_turn(s.client, s.model_id, b_msgs, p["fg_max_tokens"], agent="fg-b")
    b_msgs.append({"role": "assistant", "content": b.text})
    before = s.io()["write_bytes"]
    beside = stream_turn(s.client, s.model_id, a_req, p["fg_max_tokens"], agent="fg-a")
    during = s.io()["write_bytes"] - before
    return {"layout": s.layout, "rep": rep, "quiet": quiet.row(), "saver": b.row(), "beside": beside.row(),
            "written_during_beside": during}
