"""EXP-017's byte measurements, both layouts in one run: bytes written per turn, and bytes on disk for
agents sharing a system prompt. Every server runs with ``--sync-saves``: a reply means its save is done."""

from __future__ import annotations

from harness.prompts import question, shared_prefix, system_prompt, user_history
from harness.servers.client import stream_turn
from harness.trials.block_store.measure import added_tokens, disk_usage, ideal_shared_bytes, io_delta
from harness.trials.block_store.measure import write_amplification as amplification
from harness.trials.block_store.servers import LayoutServer, wait_idle

WRITER_USER = 7      # the corpus offsets of the writer's history and questions (harness.prompts)
SHARED_USER = 200    # the shared-prompt agents' questions: SHARED_USER + i


def _per_token(servers: list[LayoutServer]) -> float:
    """KV bytes per token; every layout serves the same model, so they must agree."""
    values = {s.layout: s.bytes_per_token() for s in servers}
    if len(set(values.values())) != 1:
        raise RuntimeError(f"the layouts' servers disagree on KV bytes per token: {values}")
    return next(iter(values.values()))


def write_amplification(servers: list[LayoutServer], p: dict, tok) -> dict:
    """One agent per server over a ``wa_system_tokens`` + ``wa_history_tokens`` history (its first turn,
    not measured), then ``wa_turns`` turns that each add a ``wa_turn_tokens`` question and a reply: per
    turn, the server process's ``write_bytes`` from just before the request to after the reply (polled
    until it stays put), over the KV bytes the turn added. The layouts alternate turn by turn."""
    bpt = _per_token(servers)
    first = [system_prompt(tok, p["wa_system_tokens"]), *user_history(tok, WRITER_USER, p["wa_history_tokens"]),
             question(tok, WRITER_USER, 0, p["wa_turn_tokens"])]
    histories = {s.layout: list(first) for s in servers}
    rows, prev = [], {}
    for s in servers:
        t = stream_turn(s.client, s.model_id, histories[s.layout], p["max_tokens"], agent="writer")
        histories[s.layout].append({"role": "assistant", "content": t.text})
        rows.append(t.row(layout=s.layout, turn=0, measured=False))
        prev[s.layout] = t
    for n in range(1, p["wa_turns"] + 1):
        for s in servers if n % 2 else servers[::-1]:
            row, prev[s.layout] = _measured_turn(s, servers, histories[s.layout], n, p, tok, bpt, prev[s.layout])
            rows.append(row)
    return {"bytes_per_token": bpt, "rows": rows}


def _measured_turn(s: LayoutServer, servers, history: list[dict], n: int, p: dict, tok, bpt: float, prev):
    """One measured turn of the writer: its row, and the turn (the next one's previous)."""
    wait_idle(servers, p["settle_s"], p["settle_max_s"])
    history.append(question(tok, WRITER_USER, n, p["wa_turn_tokens"]))
    before = s.io()
    t = stream_turn(s.client, s.model_id, history, p["max_tokens"], agent="writer")
    (after,) = wait_idle([s], p["settle_s"], p["settle_max_s"])  # --sync-saves: saved at the reply; polled
    delta = io_delta(before, after)
    history.append({"role": "assistant", "content": t.text})
    added = added_tokens(t.prompt_tokens, t.cached_tokens, t.completion_tokens)
    return t.row(layout=s.layout, turn=n, measured=True, written_bytes=delta["write_bytes"], io=delta,
                 added_tokens=added, added_bytes=added * bpt, prev_prompt_tokens=prev.prompt_tokens,
                 prev_total_tokens=prev.prompt_tokens + prev.completion_tokens,
                 amplification=amplification(delta["write_bytes"], added, bpt)), t


def shared_prompt(servers: list[LayoutServer], p: dict, tok) -> dict:
    """``shared_agents`` agents, each one turn: a ``shared_system_tokens`` system prompt and a short question
    of its own (the layouts alternate agent by agent). Then each cache directory's bytes against the
    ideal: one copy of the shared prompt plus every agent's own tokens (prompt beyond it, and reply)."""
    system = system_prompt(tok, p["shared_system_tokens"])
    msgs = [[system, question(tok, SHARED_USER + i, 1, p["shared_question_tokens"])] for i in range(p["shared_agents"])]
    shared = shared_prefix([list(tok.apply_chat_template(m, add_generation_prompt=True)) for m in msgs])
    rows = []
    for i, m in enumerate(msgs):
        for s in servers if i % 2 == 0 else servers[::-1]:
            t = stream_turn(s.client, s.model_id, m, p["max_tokens"], agent=f"shared-{i}")
            rows.append(t.row(layout=s.layout, agent=i, own_tokens=t.prompt_tokens - shared + t.completion_tokens))
    wait_idle(servers, p["settle_s"], p["settle_max_s"])
    bpt = _per_token(servers)
    block = servers[0].stats()["pool"]["block_tokens"]
    full = shared // block * block   # the shared prompt's tokens in full blocks; the rest is in each agent's tail
    disk = {}
    for s in servers:
        own = [r["own_tokens"] for r in rows if r["layout"] == s.layout]
        usage = disk_usage(s.cache_dir)
        ideal = ideal_shared_bytes(bpt, shared, own)
        # what a layout sharing full blocks only can reach: each agent also keeps the prompt's partial block
        block_ideal = ideal_shared_bytes(bpt, full, [n + shared - full for n in own])
        disk[s.layout] = {**usage.as_dict(), "ideal_bytes": ideal, "over_ideal": usage.bytes / ideal,
                          "full_block_ideal_bytes": block_ideal, "over_full_block_ideal": usage.bytes / block_ideal,
                          "server_disk": s.stats()["disk"]}
    return {"bytes_per_token": bpt, "shared_tokens": shared, "shared_full_block_tokens": full, "rows": rows,
            "disk": disk}
