"""Which cache file the injector damages, and which agents a damaged file excuses.

In the block layout an agent's cache is its manifest and the block files the manifest names; a block
file may be named by several manifests (a shared system prompt, a shared first turn). The injector
damages, in turn, the kind of :data:`KINDS` damaged least so far that has a file:

    shared_block   a block file two manifests or more name: every agent whose manifest names it loses
                   the tokens from that block on (at most: once an agent has written the block again,
                   or the pool holds it, the others find it whole), never gets a wrong reply
    manifest       an agent's manifest: that agent misses (the scan at the next start quarantines it)
    block          a block file one manifest names: that agent resumes from the blocks before it

(A run on the single-file layout damages the agents' cache files, as before.)

A damaged block file whose tensors alone were hit is found only when it is read, and a load reads no
block the pool already holds: such a file may sit unread for lives, and a save may name it in a new
manifest meanwhile. Once quarantined it may not come back: an agent that used only a prefix of it
writes a block file of its own prefix (another key). So while a damaged block file stays in place,
or is gone and not written again, every agent whose manifest names it is excused again at each
restart (:meth:`Damage.excuses_now`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness import storefiles
from semantic.store import file_name

KINDS = ("shared_block", "manifest", "block")
TENANT = "public/"   # the server keeps an agent as "<tenant>/<agent id>"; without an API key the tenant is public


@dataclass(slots=True)
class Damage:
    """A file the injector damaged: what it is, which agents use it, and its identity once damaged."""

    path: Path
    kind: str                      # "manifest", "block" or "file" (the single-file layout)
    agents: set[str]               # the fleet's agent ids whose caches use it
    shared: bool                   # a block file more than one manifest named (now or before)
    detail: dict = field(default_factory=dict)
    ident: tuple | None = None     # (inode, size, mtime) right after the damage
    row: dict = field(default_factory=dict)  # its "corrupt" event in the ledger
    pick: str = ""                 # which of KINDS (or "file") it was chosen as

    def seal(self) -> None:
        st = self.path.stat()
        self.ident = (st.st_ino, st.st_size, st.st_mtime_ns)

    def state(self) -> str:
        """"damaged": still where it was, unchanged; "gone": quarantined or deleted; "rewritten": a new file
        in its place (a block file written again under its key, an agent's new manifest)."""
        try:
            st = self.path.stat()
        except OSError:
            return "gone"
        return "damaged" if self.ident == (st.st_ino, st.st_size, st.st_mtime_ns) else "rewritten"

    def excuses_now(self, cache_dir: Path) -> set[str]:
        """The agents this damage still excuses at a restart: while a damaged block file stays in place, or
        is gone and not written again, every agent whose manifest names it (it loads the blocks before it);
        a manifest or single file while it stays in place, its agent."""
        st = self.state()
        if self.kind != "block":
            return set(self.agents) if st == "damaged" else set()
        if st == "rewritten":
            return set()
        users = storefiles.block_users(storefiles.read_manifests(cache_dir)).get(self.path.name, set())
        return _ids(users)

    @property
    def strict(self) -> bool:
        """Whether its agents' next resumption must miss: a damaged manifest, a block file only one agent
        names, a single-file cache (a shared block may be written again by another agent, or pooled)."""
        return not self.shared

    def event(self) -> dict:
        agents = sorted(self.agents)
        return {"kind_of_file": self.kind, "agents": agents, "agent": agents[0] if agents else None,
                "shared": self.shared, **self.detail}


def fleet_id(agent_id: str) -> str | None:
    """The fleet's agent id of a stored agent id (None: not one of the fleet's, e.g. another tenant)."""
    return agent_id[len(TENANT):] if agent_id.startswith(TENANT) else None


def _ids(stored: set[str]) -> set[str]:
    return {a for a in (fleet_id(s) for s in stored) if a is not None}


def candidates(cache_dir: Path, fleet_agents: list[str]) -> dict[str, list[Damage]]:
    """Every file the injector could damage now, by :data:`KINDS` (and "file": single-file caches)."""
    docs = storefiles.read_manifests(cache_dir)
    users = storefiles.block_users(docs)
    out: dict[str, list[Damage]] = {k: [] for k in (*KINDS, "file")}
    for m in docs:
        out["manifest"].append(Damage(m.path, "manifest", _ids({m.agent_id}), False))
    for path in storefiles.block_files(cache_dir):
        named = users.get(path.name)
        if named:  # a block file no manifest names is garbage the next start deletes: nobody to excuse
            kind = "shared_block" if len(named) > 1 else "block"
            out[kind].append(Damage(path, "block", _ids(named), len(named) > 1))
    by_file = {file_name(TENANT + a): a for a in fleet_agents}
    for path in storefiles.single_files(cache_dir):
        out["file"].append(Damage(path, "file", {by_file[path.name]} if path.name in by_file else set(), False))
    return out


def wanted(done: list[str]) -> list[str]:
    """The kinds in the order the next damage tries them: of :data:`KINDS` the one damaged least so far
    first (``done``: the kinds damaged, in order; ties in :data:`KINDS` order), single-file caches last."""
    return sorted(KINDS, key=lambda k: (done.count(k), KINDS.index(k))) + ["file"]


def choose(cache_dir: Path, fleet_agents: list[str], live: set[str], done: list[str],
           rng: np.random.Generator) -> Damage | None:
    """The next file to damage: of the first kind of :func:`wanted` that has a file now, a live agent's
    where possible."""
    found = candidates(cache_dir, fleet_agents)
    kind = next((k for k in wanted(done) if found[k]), None)
    if kind is None:
        return None
    pool = [d for d in found[kind] if d.agents & live] or found[kind]
    d = pool[int(rng.integers(len(pool)))]
    d.pick = kind
    return d
