"""The restore-overlap probe computes the same turn both ways: its figure compares like with like."""

from __future__ import annotations

from harness.analysis import restore_overlap


def test_a_forward_that_waits_for_each_layers_bytes_gives_the_serial_turns_logits(tmp_path):
    restore_overlap.write(tmp_path, 512)
    serial = restore_overlap.trial("serial", tmp_path, 512)
    overlap = restore_overlap.trial("overlap", tmp_path, 512)
    assert serial["logits"] == overlap["logits"]
    assert len(serial["logits"]) == 64 and any(x != 0.0 for x in serial["logits"])
