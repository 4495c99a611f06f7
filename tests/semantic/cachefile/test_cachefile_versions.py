"""Cache files written under mlx-lm 0.30.4 and under 0.32.x load under
whichever version runs, and continue exactly like a fresh prefill.

The files in tests/data/ were written by ``python -m tests.persistence_fixtures``
under each version (see tests/data/README.md). ``make test`` runs this under
0.32.x, ``make test-compat`` under 0.30.4: both directions.
"""

from __future__ import annotations

import pytest

from semantic import Request, cachefile
from tests.cache_helpers import check_executor, make_executor, run, weights_fingerprint
from tests.persistence_fixtures import DATA, FIXTURES, expected, model_for

pytestmark = pytest.mark.compat

FILES = sorted(DATA.glob("cache-v*-*.safetensors"))
STEPS = 16


def test_fixtures_cover_every_readable_format_version_and_both_supported_mlx_lm_versions():
    infos = [cachefile.read_header(p) for p in FILES]
    written = {(i.format_version, i.agent_id, i.mlx_lm_version[:4]) for i in infos}
    assert written == {
        (version, name, v) for version in cachefile.READABLE_VERSIONS for name in expected(version) for v in ("0.30", "0.32")
    }
    # version 2's edge fixture stores the window edge's whole block: its sliding tensors start before the window
    assert all(bool(i.stored_from) == i.agent_id.endswith("-edge") for i in infos)


@pytest.mark.parametrize("path", FILES, ids=[p.stem.split("-", 2)[2] for p in FILES])
def test_a_file_from_either_version_loads_and_continues_like_a_fresh_prefill(path):
    info = cachefile.read_header(path)
    model, kv_bits = model_for(info.agent_id)
    executor = make_executor(model, kv_bits)
    loaded = cachefile.load(path, executor.pool, model_fingerprint=weights_fingerprint(model))
    _, _, history_len, generated, _ = FIXTURES[info.agent_id]
    assert loaded.total_tokens == history_len + generated
    T = [21, 22, 23]
    cont = executor.submit(Request("a", [*loaded.token_ids, *T], STEPS), loaded, share=False)
    ref = executor.submit(Request("b", list(loaded.token_ids) + T, STEPS), share=False)
    done = run(executor)
    assert done[cont].cached_tokens == loaded.total_tokens
    assert done[cont].token_ids == done[ref].token_ids
    check_executor(executor, done[cont], done[ref])  # both mlx-lm's own generation, within its measured noise
