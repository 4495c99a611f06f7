"""The servers EXP-019 runs, each on 127.0.0.1 with its own cache directory and log.

* :class:`FleetServer`: one ``semantic serve`` with several models (``--model ID=DIR`` each), a memory bound
  (``--models-mb``) and optionally pinned models (``--pin ID``).
* :func:`single_server`: ``semantic serve`` with one bare ``--model DIR --model-id ID``: today's server,
  its model loaded at start and never unloaded.
* :func:`start_mlx_lm`: ``mlx_lm.server --model DIR``; it loads whatever directory a request names as
  ``model`` (one model at a time) and keys its prompt caches by model.

Ours import ``semantic`` from this checkout (:class:`~harness.servers.ours.OurServer`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from harness.servers.ours import OurServer, get_json

MB = 2**20


class FleetServer(OurServer):
    """``semantic serve`` serving every model of ``models`` (id -> directory); the first is the default."""

    def __init__(self, models: dict[str, Path], cache_dir: Path, log_path: Path, args: list[str],
                 ready_timeout_s: float = 300.0):
        first = next(iter(models))
        super().__init__(models[first], first, cache_dir, log_path, args, ready_timeout_s)
        self.models = dict(models)

    def command(self) -> list[str]:
        flags = [a for mid, d in self.models.items() for a in ("--model", f"{mid}={d}")]
        return [sys.executable, "-m", "semantic.serve", *flags, "--host", "127.0.0.1", "--port", str(self.port),
                "--cache-dir", str(self.cache_dir), *self.args]


def single_server(model_id: str, model_dir: Path, work: Path, args: list[str]) -> OurServer:
    """Today's server of one model, its state under ``work/single-<id>`` (kept across its restarts)."""
    work.mkdir(parents=True, exist_ok=True)
    return OurServer(model_dir, model_id, work / f"single-{model_id}", work / f"single-{model_id}.log", args)


def start_mlx_lm(model_dir: Path, work: Path, ready_timeout_s: float = 300.0):
    """``mlx_lm.server`` on ``model_dir`` (its default model), with the OpenBLAS ours use; returns its
    :class:`~harness.servers.processes.Running`."""
    from harness.servers import processes
    from harness.servers.targets import MLX_LM, TARGETS

    return processes.start(TARGETS[MLX_LM], model_dir, processes.free_port(), work / "mlx_lm",
                           ready_timeout_s=ready_timeout_s)


def model_mb(model_dir: Path) -> float:
    """The weights' bytes on disk in MB (the record; the budgets count what the fleet does: ``trial.footprints``)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / MB


def model_states(url: str) -> dict[str, str | None]:
    """Each served model's ``state`` in ``/v1/models`` (None where the server does not say)."""
    doc = get_json(url, "/v1/models") or {}
    return {m.get("id"): m.get("state") for m in doc.get("data", [])}


def wait_saved(url: str, model_ids: list[str], max_s: float = 120.0) -> int:
    """Poll each model's ``/v1/cache/stats?model=ID`` until no save is pending (an unloaded model has none);
    returns what was still pending at the deadline (0: all written)."""
    deadline = time.monotonic() + max_s
    while True:
        pending = 0
        for mid in model_ids:
            st = get_json(url, f"/v1/cache/stats?model={mid}") or {}
            pending += int((st.get("saves") or {}).get("pending") or 0)
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.05)
