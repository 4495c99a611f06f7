"""Results documents: schema-valid, criteria evaluated with the measured value beside the threshold."""

from __future__ import annotations

import json

import jsonschema
import pytest

from harness import config
from harness import results
from harness.timing import Samples, time_interleaved, time_once

import mlx.core as mx


def _config(tmp_path, criteria: str = ""):
    p = tmp_path / "t.toml"
    p.write_text(
        'name = "t"\nkind = "cache_injection"\nmodels = ["smollm2-135m"]\n[protocol]\nwarmup = 0\ntrials = 3\n' + criteria
    )
    return config.load(p)


CRITERIA = """
[[criteria]]
name = "faster"
value = "comparisons.ab.ratio_p50"
op = "<"
threshold = 1.0
[[criteria]]
name = "matches"
value = "checks.match"
op = "=="
threshold = true
[[criteria]]
name = "absent"
value = "metrics.nope.stats.p50"
op = "<"
threshold = 1
"""


def _trial_code():
    return 1


def test_a_results_document_validates_and_records_verdicts_beside_thresholds(tmp_path):
    cfg = _config(tmp_path, CRITERIA)
    res = results.Results(cfg, "smollm2-135m", {"fingerprint": "abc", "path": "/m"}, [_trial_code])
    res.timing("a_ms", Samples(ms=[1.0, 2.0, 3.0], lazy_ms=[0.1, 0.1, 0.1], peak_mb=[5.0, 5.0, 6.0]))
    res.metric("b_ms", [4.0, 5.0, 6.0], "ms")
    cmp = res.compare("ab", "a_ms", "b_ms")
    assert cmp["ratio_p50"] == pytest.approx(2.0 / 5.0)
    res.check("match", True)
    verdicts = {v["name"]: v for v in res.evaluate()}
    assert verdicts["faster"]["pass"] and verdicts["faster"]["measured"] == pytest.approx(0.4)
    assert verdicts["matches"]["verdict"] == "PASS"
    assert verdicts["absent"]["verdict"] == "FAIL" and "not in the results" in verdicts["absent"]["note"]
    assert res.doc["verdict"] == "FAIL"

    path = res.write(tmp_path / "out")
    doc = json.loads(path.read_text())
    results.validate(doc)
    assert doc["packages"]["mlx"] and doc["packages"]["mlx-lm"]
    assert doc["metrics"]["a_ms"]["lazy_ms"]["samples"] == [0.1, 0.1, 0.1]
    assert len(doc["config_sha256"]) == 64 and len(doc["benchmark_id"]) == 16
    assert not list((tmp_path / "out").glob(".tmp-*"))


def test_the_schema_rejects_a_document_missing_its_samples(tmp_path):
    res = results.Results(_config(tmp_path), "smollm2-135m", None, [_trial_code])
    res.metric("a_ms", [1.0, 2.0], "ms")
    res.evaluate()
    doc = json.loads(json.dumps(res.doc))
    del doc["metrics"]["a_ms"]["samples"]
    with pytest.raises(jsonschema.ValidationError):
        results.validate(doc)
    doc = json.loads(json.dumps(res.doc))
    doc["metrics"]["a_ms"]["direction"] = "sideways"
    with pytest.raises(jsonschema.ValidationError):
        results.validate(doc)


def test_benchmark_identity_changes_with_params_and_code_but_not_trial_counts(tmp_path):
    cfg = _config(tmp_path)
    more = config.load(tmp_path / "t.toml", overrides=["protocol.trials=9"])
    other = config.load(tmp_path / "t.toml", overrides=["params.history_tokens=3"])
    base = results.benchmark_id(cfg, "m", [_trial_code])
    assert results.benchmark_id(more, "m", [_trial_code]) == base
    assert results.benchmark_id(other, "m", [_trial_code]) != base
    assert results.benchmark_id(cfg, "m", [_test_helper]) != base
    assert results.benchmark_id(cfg, "other-model", [_trial_code]) != base


def _test_helper():
    return 2


def test_timing_ends_in_materialization_and_keeps_the_lazy_time_apart():
    a = mx.random.normal((512, 512))
    mx.eval(a)
    ms, lazy, peak = time_once(lambda: [a @ a @ a @ a])
    assert lazy <= ms and peak > 0
    out = time_interleaved({"x": lambda: a + 1, "y": lambda: a * 2}, config.Protocol(warmup=1, trials=4))
    assert [len(out[k].ms) for k in "xy"] == [4, 4]
    assert all(l <= m for l, m in zip(out["x"].lazy_ms, out["x"].ms))
