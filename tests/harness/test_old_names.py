"""harness.old_names: results documents written under older names read as today's, and are never rewritten."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from harness import old_names
from harness.analysis import compare
from harness.trials.reconstruction.trial import expected_p95_table

OLD_EXP_006 = Path(__file__).parents[2] / "results" / "exp_006_reconstruction" / "20261122T102758Z-synthetic.json"


def test_an_old_exp_006_document_reads_with_todays_names_and_is_left_as_it_was():
    doc = json.loads(OLD_EXP_006.read_text())
    before = copy.deepcopy(doc)
    new = old_names.upgrade(doc)
    assert doc == before
    assert new["checks"]["cell_b32_l48_reconstruct_p95_ms"] == doc["checks"]["seed_b32_l48_reconstruct_p95_ms"]
    assert not [k for k in new["checks"] if k.startswith("seed_")]
    assert new["outputs"]["expected_p95_table"][0]["verdict_concat"] == doc["outputs"]["seed_table"][0]["verdict_seed_method"]
    assert "checks.cell_b32_l48_reconstruct_p95_ms" in [c["value"] for c in new["criteria"]]
    assert old_names.upgrade(new) == new


def test_readers_of_documents_see_todays_names():
    assert "cell_b1_l12_concat_p95_ms" in compare.load(OLD_EXP_006)["checks"]
    lines = expected_p95_table(json.loads(OLD_EXP_006.read_text()))
    assert len(lines) == 4 and "direct concat" in lines[0]


def test_other_names_and_other_things_pass_unchanged():
    assert old_names.check_name("seed_count") == "seed_count"
    assert old_names.check_name("smollm2_2k_reconstruct_over_memcpy") == "smollm2_2k_reconstruct_over_memcpy"
    assert old_names.upgrade([1, 2]) == [1, 2]


def test_a_trial_source_reads_with_the_module_paths_and_names_its_benchmark_ids_were_made_with():
    moved = "from harness.servers.ours import OurServer\nfrom harness.trials.multi_model.servers import model_mb\n"
    assert old_names.trial_source(moved) == ("from harness.chaos.server import ChaosServer\n"
                                             "from harness.multimodel.servers import model_mb\n")
    assert old_names.trial_source("from harness.prompts import system_prompt") == "from harness.prompts import system_prompt"
