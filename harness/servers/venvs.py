"""Peers' installs: each peer in its own git-ignored venv under ``.peers/``, built once per install recipe.

A peer is a server (:class:`~harness.servers.targets.ServerTarget`) or a
client tool such as a load generator: anything with a ``name``, a ``venv``
folder and an ``install`` recipe (:class:`Recipe`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.servers.targets import ROOT, ServingError, log_tail

PEERS = ".peers"            # git-ignored: one venv per peer
STAMP = "semantic-install.json"


class Recipe(Protocol):
    """What :func:`ensure_venv` needs of a peer: a name, its folder under ``.peers/``, pip argument lists."""

    @property
    def name(self) -> str: ...
    @property
    def venv(self) -> str | None: ...
    @property
    def install(self) -> tuple[tuple[str, ...], ...]: ...


@dataclass(frozen=True, slots=True)
class ToolRecipe:
    """A client tool installed like a peer (a load generator): a venv and a recipe, no server to start."""

    name: str
    venv: str
    install: tuple[tuple[str, ...], ...]


class InstallError(ServingError):
    """A peer's install recipe failed; the message ends with the tail of its install log."""


@dataclass(frozen=True, slots=True)
class Venv:
    """A target's interpreter and what is installed beside it."""

    python: Path
    versions: Mapping[str, str]       # every distribution: name -> version
    install_s: float | None           # seconds the recipe took when it ran; None for .venv
    installed_now: bool               # False when the stamp said it was already done

    def pick(self, names: Sequence[str]) -> dict[str, str | None]:
        """The versions of ``names`` (a target's ``packages``), None where not installed."""
        norm = {_norm(k): v for k, v in self.versions.items()}
        return {n: norm.get(_norm(n)) for n in names}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def recipe_hash(target: Recipe) -> str:
    """sha256 of the install recipe: a changed recipe means a fresh venv."""
    return hashlib.sha256(json.dumps([list(a) for a in target.install]).encode()).hexdigest()


def installed_versions(python: Path | str) -> dict[str, str]:
    """Every distribution ``python`` sees, name -> version (importlib.metadata, so no pip needed)."""
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ServingError(f"{python} could not list its packages: {done.stderr[-1000:]}")
    return dict(sorted(json.loads(done.stdout.strip().splitlines()[-1]).items(), key=lambda kv: kv[0].lower()))


def venv_dir(target: Recipe, root: Path = ROOT) -> Path:
    """Where a peer's venv lives: ``<root>/.peers/<venv>``."""
    if target.venv is None:
        raise ValueError(f"{target.name} runs in this interpreter's venv, not under {PEERS}/")
    return Path(root) / PEERS / target.venv


def ensure_venv(target: Recipe, root: Path = ROOT, *, base_python: str = "python3",
                pip: Sequence[str] | None = None) -> Venv:
    """Create ``.peers/<venv>/`` and run the install recipe once; a second call only reads the stamp.

    The stamp (``semantic-install.json``) holds the recipe's hash: a venv whose
    stamp is missing (a failed or interrupted install) or names another recipe
    is deleted and built again from nothing.

    Args:
        base_python: the interpreter that creates the venv (``python3 -m venv``).
        pip: the command that installs into the venv, each recipe line appended
            (default: the venv's own ``python -m pip``; then the venv gets pip).

    Returns:
        The :class:`Venv` with its python and exact installed versions.

    Raises:
        InstallError: a recipe line failed (with the install log's tail).
    """
    if target.venv is None:
        return Venv(Path(sys.executable), installed_versions(sys.executable), None, False)
    where = venv_dir(target, root)
    python = where / "bin" / "python"
    stamp = where / STAMP
    want = recipe_hash(target)
    if stamp.is_file():
        done = json.loads(stamp.read_text())
        if done.get("recipe_sha256") == want and python.exists():
            return Venv(python, done["versions"], done["install_s"], False)
    if where.exists():
        shutil.rmtree(where)
    where.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    create = [base_python, "-m", "venv", str(where)] + (["--without-pip"] if pip is not None else [])
    _run_logged(target, create, where.parent / f"{target.venv}.venv.log")
    log = where / "install.log"
    for args in target.install:
        _run_logged(target, [*(pip if pip is not None else [str(python), "-m", "pip"]), "install", *args], log)
    install_s = time.perf_counter() - t0
    versions = installed_versions(python)
    stamp.write_text(json.dumps({"target": target.name, "recipe": [list(a) for a in target.install],
                                 "recipe_sha256": want, "install_s": round(install_s, 3),
                                 "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions},
                                indent=1))
    return Venv(python, versions, install_s, True)


def _run_logged(target: Recipe, cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise InstallError(f"{target.name}: `{' '.join(cmd)}` exited {rc}; {log}:\n{log_tail(log)}")
