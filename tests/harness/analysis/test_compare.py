"""compare flags a metric only for a large AND significant change, and refuses to compare different benchmarks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.analysis import compare
from harness.stats import summarize


def _doc(samples, bid="aaaa", direction="lower", metric="t_ms", run="20261122T000000Z-m"):
    return {
        "experiment": "e", "benchmark_id": bid, "run_id": run, "packages": {"mlx": "x", "mlx-lm": "y"},
        "metrics": {metric: {"unit": "ms", "direction": direction, "samples": list(map(float, samples)),
                             "stats": summarize(samples)}},
    }


def _normal(seed, n=50, scale=1.0):
    return np.random.default_rng(seed).normal(10.0 * scale, 0.5, n)


def test_a_known_thirty_percent_slowdown_is_flagged_and_exits_nonzero(tmp_path):
    base, slow = _doc(_normal(0)), _doc(_normal(1, scale=1.3))
    c = compare.compare([base, slow])
    row = c.table.iloc[0]
    assert row["flag"] == "regression" and row["ratio"] > 1.25 and row["p_value"] < 1e-6
    paths = []
    for name, d in (("a.json", base), ("b.json", slow)):
        (tmp_path / name).write_text(json.dumps(d))
        paths.append(str(tmp_path / name))
    assert compare.main(paths) == 1
    assert compare.main(paths[::-1]) == 0  # the other way round it is an improvement


def test_two_draws_of_the_same_distribution_print_as_approximately_equal(tmp_path, capsys):
    c = compare.compare([_doc(_normal(2)), _doc(_normal(3))])
    assert c.table.iloc[0]["flag"] == "~" and c.table.iloc[0]["shown"].startswith("~")
    assert "no regression flagged" in compare.format_table(c)


def test_a_large_shift_on_three_samples_is_not_significant():
    c = compare.compare([_doc([10, 10.1, 9.9]), _doc([13, 13.1, 12.9])])
    assert c.table.iloc[0]["ratio"] > 1.25 and c.table.iloc[0]["flag"] == "~"


def test_higher_is_better_metrics_regress_when_they_drop():
    c = compare.compare([_doc(_normal(4), direction="higher"), _doc(_normal(5, scale=0.7), direction="higher")])
    assert c.table.iloc[0]["flag"] == "regression"


def test_a_known_thirty_percent_speedup_is_an_improvement_in_either_direction():
    c = compare.compare([_doc(_normal(0)), _doc(_normal(1, scale=0.7))])
    assert c.table.iloc[0]["flag"] == "improvement" and c.table.iloc[0]["shown"] == "improvement 0.70x"
    c = compare.compare([_doc(_normal(0), direction="higher"), _doc(_normal(1, scale=1.3), direction="higher")])
    assert c.table.iloc[0]["flag"] == "improvement" and len(c.regressions) == 0


def test_different_benchmark_ids_are_not_comparable_and_missing_metrics_are_listed(tmp_path, capsys):
    a, b = _doc(_normal(6)), _doc(_normal(7, scale=2), bid="bbbb")
    c = compare.compare([a, b])
    assert c.table.empty and "NOT COMPARABLE" in c.not_comparable[0]
    assert "no metric was compared" in compare.format_table(c)  # not "no regression", nor a crash
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "NOT COMPARABLE" in capsys.readouterr().out
    c = compare.compare([_doc(_normal(6)), _doc(_normal(7), metric="other_ms")])
    assert c.missing == ["20261122T000000Z-m (mlx x, mlx-lm y): t_ms only in the baseline",
                         "20261122T000000Z-m (mlx x, mlx-lm y): other_ms not in the baseline"]
    assert c.table.empty and list(c.table.columns) == compare.COLUMNS


def test_a_metric_whose_unit_changed_is_not_compared():
    after = _doc(_normal(7, scale=2))
    after["metrics"]["t_ms"]["unit"] = "s"
    c = compare.compare([_doc(_normal(6)), after])
    assert c.table.empty and "t_ms is s" in c.not_comparable[0]


def test_a_zero_baseline_gives_an_infinite_ratio_not_a_warning():
    c = compare.compare([_doc([0.0] * 20), _doc([1.0] * 20)])
    assert c.table.iloc[0]["ratio"] == float("inf") and c.table.iloc[0]["flag"] == "regression"
    assert compare.compare([_doc([0.0] * 5), _doc([0.0] * 5)]).table.iloc[0]["shown"] == "~1.00"


def test_an_unreadable_file_is_an_error_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert compare.main([str(bad), str(bad)]) == 2
    assert "bad.json" in capsys.readouterr().err
    assert compare.main([str(tmp_path / "absent.json"), str(bad)]) == 2
    assert "absent.json" in capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("benchmark_id"), "no 'benchmark_id'"),
    (lambda d: d["metrics"]["t_ms"].update(direction="up"), "'t_ms' direction is 'up'"),
    (lambda d: d["metrics"]["t_ms"].update(samples=[]), "'t_ms' needs a non-empty list"),
    (lambda d: d["metrics"]["t_ms"].pop("unit"), "'t_ms' has no unit"),
])
def test_a_document_missing_what_compare_needs_is_named_with_its_file(tmp_path, edit, message):
    doc = _doc(_normal(0))
    edit(doc)
    (tmp_path / "x.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="x.json: .*" + message):
        compare.load(tmp_path / "x.json")


def test_a_moved_control_metric_is_called_out_as_machine_drift():
    base, after = _doc(_normal(8)), _doc(_normal(9, scale=1.3))
    base["metrics"]["t_ms"]["control"] = True
    text = compare.format_table(compare.compare([base, after]))
    assert "WARNING: control metric t_ms moved" in text


def test_runs_on_machines_with_different_blas_or_devices_are_told_apart():
    fast = {"mlx_device": "Device(cpu, 0)", "cpu_count": 2, "system": "Linux", "processor": "AMD EPYC",
            "blas": {"blas": "openblas"}, "matmul_gflops_f32": 120.0}
    slow = dict(fast, blas={"blas": "bundled-reference"}, matmul_gflops_f32=3.9)
    base, other = _doc(_normal(2)), _doc(_normal(3))
    base["machine_info"], other["machine_info"] = slow, fast
    c = compare.compare([base, other])
    assert any("BLAS bundled-reference -> openblas" in m for m in c.machines)
    assert any("f32 matmul 3.9 -> 120.0 GFLOP/s" in m for m in c.machines)
    assert "MACHINE:" in compare.format_table(c)
    other["machine_info"] = dict(slow, matmul_gflops_f32=4.5)  # measurement noise is not a different machine
    assert compare.compare([base, other]).machines == []
