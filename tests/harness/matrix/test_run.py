"""The matrix's bookkeeping: types dealt to side-by-side runs, and their rows merged into one results file
(no model is served here: ``test_matrix`` serves them)."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from harness.matrix.check import ModelResult, TurnResult
from harness.matrix.run import main, shares, write


def test_types_are_dealt_round_robin_to_the_jobs_and_no_share_is_empty():
    types = [f"t{i}" for i in range(5)]
    assert shares(types, 2) == [["t0", "t2", "t4"], ["t1", "t3"]]
    assert shares(types, 1) == [types]
    assert shares(["a", "b"], 4) == [["a"], ["b"]]
    assert sorted(sum(shares(types, 3), [])) == types


def _result(model_type: str, echo: bool, passed: bool = True) -> ModelResult:
    turn = TurnResult("append", "a", 10, 9, 9, passed, 0.0, 1e-6, 4e-6)
    return ModelResult(model_type, echo, ["global"], [turn], None, 1.0)


def test_rows_from_several_runs_go_into_one_file_in_type_order_and_an_update_keeps_the_other_types(tmp_path):
    write([_result("b", False), _result("b", True), _result("a", True), _result("a", False)], tmp_path, ["a", "b"])
    path = tmp_path / f"mlx-lm-{version('mlx-lm')}.json"
    rows = json.loads(path.read_text())["results"]
    assert [(r["model_type"], r["echo"]) for r in rows] == [("a", True), ("a", False), ("b", True), ("b", False)]
    # a rerun of one type replaces its rows and keeps the others'
    write([_result("a", True, passed=False), _result("a", False)], tmp_path, ["a"], update=True)
    rows = json.loads(path.read_text())["results"]
    assert [(r["model_type"], r["echo"], r["passed"]) for r in rows] == [
        ("a", True, False), ("a", False, True), ("b", True, True), ("b", False, True)]
    table = (tmp_path / f"mlx-lm-{version('mlx-lm')}.md").read_text()
    assert table.startswith("1 of 2 model types pass every check")


def test_jobs_below_one_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--types", "llama", "--jobs", "0"])
    assert "--jobs 0" in capsys.readouterr().err
