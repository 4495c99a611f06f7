"""The support matrix's short run (``make model-matrix`` runs every model type): one model of each kind
that resumes only from snapshots or shares KV, served by a real ``Service`` in a child process, SIGKILLed
after its saves and restarted, every turn held against mlx-lm's ``generate_step`` on the same ids."""

from __future__ import annotations

import pytest

from harness.matrix.check import check
from harness.matrix.run import SHORT

pytestmark = pytest.mark.compat


@pytest.mark.parametrize("echo", [True, False], ids=["echo", "no-echo"])
@pytest.mark.parametrize("model_type", SHORT)
def test_a_served_model_of_each_kind_is_exact_and_reuses_every_turn_type(model_type, echo, tmp_path):
    from harness.models import zoo

    if model_type not in zoo.model_types():
        pytest.skip(f"this mlx-lm has no {model_type}")
    r = check(model_type, tmp_path, echo=echo, timeout_s=300)
    assert r.error is None, r.error
    bad = [t for t in r.turns if not (t.exact and t.reused)]
    assert not bad, bad
    assert {t.turn for t in r.turns} >= {"append", "regenerate", "edit", "branch", "second_agent", "restart"}
