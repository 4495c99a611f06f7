"""Criteria levels: a run fails only on a must-have (P0) unless --strict; every level is recorded."""

from __future__ import annotations

import json
import tomllib

import pytest

from harness import cli, config
from harness.trials.base import KINDS, TrialKind

CHECK_CRITERIA = """
[[criteria]]
name = "the must-have"
level = "P0"
value = "checks.answer"
op = "=="
threshold = {must}

[[criteria]]
name = "the stretch goal"
level = "stretch"
value = "checks.answer"
op = "=="
threshold = {stretch}
"""


@pytest.fixture
def answer_kind(monkeypatch):
    """A kind without a model that records checks.answer = 42."""
    kind = TrialKind(name="answer", run=lambda ctx: ctx.results.check("answer", 42), params={}, needs_model=False)
    monkeypatch.setitem(KINDS, "answer", kind)
    return kind


def _config(tmp_path, criteria: str) -> str:
    path = tmp_path / "answer.toml"
    path.write_text('name = "answer"\nkind = "answer"\nmodels = ["none"]\n[protocol]\nwarmup = 0\ntrials = 1\n' + criteria)
    return str(path)


def _run(tmp_path, must: int, stretch: int, flags: tuple[str, ...] = ()) -> tuple[int, dict]:
    code = cli.main(["run", _config(tmp_path, CHECK_CRITERIA.format(must=must, stretch=stretch)),
                     "--out", str(tmp_path / "out"), *flags])
    (path,) = (tmp_path / "out" / "answer").glob("*.json")
    doc = json.loads(path.read_text())
    path.unlink()
    return code, doc


def test_a_run_whose_only_failure_is_a_stretch_goal_exits_zero(answer_kind, tmp_path):
    code, doc = _run(tmp_path, must=42, stretch=0)
    assert code == 0
    assert doc["verdict"] == "FAIL" and doc["must_haves_pass"] is True


def test_a_run_with_a_failed_must_have_exits_one(answer_kind, tmp_path):
    code, doc = _run(tmp_path, must=0, stretch=42)
    assert code == 1
    assert doc["verdict"] == "FAIL" and doc["must_haves_pass"] is False


def test_strict_exits_one_when_any_criterion_fails(answer_kind, tmp_path):
    assert _run(tmp_path, must=42, stretch=0, flags=("--strict",))[0] == 1
    assert _run(tmp_path, must=42, stretch=42, flags=("--strict",))[0] == 0


def test_a_run_that_breaks_exits_two(monkeypatch, tmp_path):
    def broken(ctx):
        raise RuntimeError("the machine caught fire")

    monkeypatch.setitem(KINDS, "answer", TrialKind(name="answer", run=broken, params={}, needs_model=False))
    assert cli.main(["run", _config(tmp_path, ""), "--out", str(tmp_path / "out")]) == 2


def test_the_results_record_each_criterions_level(answer_kind, tmp_path):
    _, doc = _run(tmp_path, must=42, stretch=0)
    assert [(c["name"], c["level"], c["pass"]) for c in doc["criteria"]] == [
        ("the must-have", "P0", True), ("the stretch goal", "stretch", False)]
    assert [c["level"] for c in doc["config"]["criteria"]] == ["P0", "stretch"]


def test_the_console_shows_verdicts_and_where_the_json_went_and_metrics_only_with_verbose(monkeypatch, tmp_path, capsys):
    def timed(ctx):
        ctx.results.check("answer", 42)
        ctx.results.metric("answer_ms", [1.0, 2.0], "ms")

    monkeypatch.setitem(KINDS, "answer", TrialKind(name="answer", run=timed, params={}, needs_model=False))
    _run(tmp_path, must=42, stretch=0)
    out = capsys.readouterr().out
    assert "stretch [FAIL] the stretch goal" in out and "results: " in out and "answer_ms" not in out
    _run(tmp_path, must=42, stretch=0, flags=("-v",))
    assert "answer_ms: p50 1.5 ms" in capsys.readouterr().out


def test_a_criterion_without_a_level_is_a_must_have(answer_kind, tmp_path):
    plain = CHECK_CRITERIA.format(must=42, stretch=0).replace('level = "P0"\n', "")
    cfg = config.load(_config(tmp_path, plain))
    assert [c.level for c in cfg.criteria] == ["P0", "stretch"]


def test_an_unknown_level_is_a_config_error(answer_kind, tmp_path):
    bad = CHECK_CRITERIA.format(must=42, stretch=0).replace('level = "stretch"', 'level = "P9"')
    with pytest.raises(config.ConfigError, match="criteria\\[1\\].*level must be one of"):
        config.load(_config(tmp_path, bad))


def test_every_packaged_criterion_states_its_level():
    for path in sorted(config.PACKAGED.glob("*.toml")):
        for c in tomllib.loads(path.read_text()).get("criteria", []):
            assert c.get("level") in ("P0", "P1", "P2", "stretch"), (path.name, c["name"])


def test_the_exp_006_one_block_comparison_is_a_stretch_goal():
    cfg = config.load("exp_006_reconstruction")
    levels = {c.value: c.level for c in cfg.criteria}
    assert levels["checks.reconstruct_many_over_one_block_max"] == "stretch"
    assert levels["checks.cell_b32_l48_turn_p95_ms"] == "P0"  # what a resumed turn does to get its cache
