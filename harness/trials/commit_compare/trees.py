"""The two sides of a comparison as source trees: this checkout as it stands, or a commit checked out in a
worktree of its own beside it (``.peers/commits/<sha>``, made once and kept; nothing of it is committed).

A server of either side is ``python -m semantic.serve`` with ``PYTHONPATH`` at its tree, from this
checkout's interpreter: the commits compared share the venv's packages (mlx, mlx-lm), so what differs is
our code alone.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.servers.targets import ROOT

HERE = ("", ".", "here", "worktree")   # this checkout, uncommitted changes included
WORKTREES = ROOT / ".peers" / "commits"


@dataclass(frozen=True, slots=True)
class Tree:
    """One side: a name for the tables, the commit it is (``dirty``: with uncommitted changes), and its root."""

    label: str
    commit: str
    root: Path
    dirty: bool = False


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def resolve(ref: str) -> Tree:
    """The tree of ``ref``: this checkout for ``""``/``"."``, else the commit's worktree (made if missing).

    Raises:
        ValueError: ``ref`` names no commit of this repository.
    """
    if ref in HERE:
        commit = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        return Tree(f"here@{commit[:8]}" + ("+" if dirty else ""), commit, ROOT, dirty)
    try:
        commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise ValueError(f"{ref!r} names no commit of {ROOT}") from None
    root = WORKTREES / commit
    if not (root / "semantic" / "__init__.py").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        _git("worktree", "prune")
        _git("worktree", "add", "--force", "--detach", str(root), commit)
    return Tree(f"{ref}@{commit[:8]}" if ref != commit else commit[:8], commit, root)
