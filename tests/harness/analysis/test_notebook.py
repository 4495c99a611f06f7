"""notebooks/analysis.ipynb runs headless against the committed results, and is committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[3] / "notebooks" / "analysis.ipynb"


def test_the_analysis_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_the_analysis_notebook_executes_against_the_committed_results():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    shown = "".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "Traceback" not in shown
    assert "exp_006_reconstruction" in shown and "reconstruct" in shown
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
