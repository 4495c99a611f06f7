"""`make test-install`: the engine installed alone (`pip install .`, no extras) runs a turn.

Run from an empty folder, read from standard input, by the venv that holds only the engine's dependencies:
it checks that none of the harness's packages came along, then builds a tiny
random-weight Llama with mlx-lm itself and runs two turns of one agent through
``ConcurrentScheduler``, the second reusing the first's cache.
"""

import importlib.util
import sys
import tempfile

# (tqdm, tokenizers and safetensors come with mlx-lm itself, through transformers)
HARNESS_ONLY = ("pandas", "matplotlib", "scipy", "gguf", "jsonschema")
present = [m for m in HARNESS_ONLY if importlib.util.find_spec(m) is not None]
assert not present, f"the engine-only install pulled harness packages: {present}"

import semantic  # noqa: E402
from semantic import blas  # noqa: E402

blas.enable()
import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from semantic import AgentCacheStore, BlockPool, ConcurrentScheduler, ModelCacheSpec, Request, encode  # noqa: E402

mx.random.seed(0)
args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=300,
                       tie_word_embeddings=True)
model = llama.Model(args)
mx.eval(model.parameters())
# a real mlx-lm tokenizer over words "t0".."t299", from packages mlx-lm itself depends on
words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0"))
words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t299"), eos_token_ids=[299])
spec = ModelCacheSpec.from_model(model)
with tempfile.TemporaryDirectory() as d:
    store = AgentCacheStore(d, spec, "tiny-smoke", disk_budget_bytes=1 << 30,
                            pool=BlockPool(spec, total_blocks=32, block_tokens=16))
    with ConcurrentScheduler(model, tokenizer, store, max_batch=2, stop_tokens=[]) as sched:
        history = " ".join(f"t{i}" for i in range(10, 60))
        first = sched.submit(Request("agent", encode(tokenizer, history), 4), timeout=None).result()
        second = sched.submit(Request("agent", tokenizer.encode(history) + list(first.token_ids) + [7, 8, 9], 4), timeout=None).result()
assert second.cached_tokens > 0, second
print(f"engine only: semantic {len(semantic.__all__)} names, 2 turns, {second.cached_tokens} tokens reused, "
      f"python {sys.version.split()[0]}")
