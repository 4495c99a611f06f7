"""``semantic serve --model DIR_OR_HUB_ID ...``: load the model (or several: ``--model ID=DIR``) and serve it over HTTP.

Also ``python -m semantic.serve`` with the same flags (the word ``serve``
may be given or left out). API keys come from ``--api-key`` (repeatable)
and ``$SEMANTIC_API_KEYS`` (comma-separated). This module imports nothing
that loads MLX: :func:`main` points MLX at a fast BLAS first.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from semantic import defaults
from semantic.serve.config import LOG_LEVELS, ServeConfig

KEYS_ENV = "SEMANTIC_API_KEYS"
ABORT_MARGIN_S = 0.5  # open turns are answered this long before uvicorn cancels their tasks


def build_parser() -> argparse.ArgumentParser:
    """The ``semantic serve`` command line.

    Returns:
        A parser of every flag, in ``--help`` order: one function below adds each group of them.
    """
    p = argparse.ArgumentParser(prog="semantic serve", description="OpenAI- and Anthropic-compatible server "
                                "with a persistent KV cache per agent.")
    d = ServeConfig(model="-")  # the defaults live in one place
    for add in FLAG_GROUPS:
        add(p, d)
    return p


def _model_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """The models, the names clients use for them, and the memory they share."""
    p.add_argument("--model", action="append", default=[], metavar="[ID=]DIR_OR_HUB_ID",
                   help="a model directory or Hugging Face hub id; repeatable as ID=DIR for several models, loaded "
                        "when a request names them (one bare --model: loaded at start and kept, as always)")
    p.add_argument("--model-id", default=None, help="the name clients use for a single --model (default: its folder's)")
    p.add_argument("--models-file", default=None, metavar="FILE",
                   help="a TOML file of models: [models.ID] path, aliases, pinned, idle_ttl_s, max_context, kv_bits, "
                        "pool_mb, ram_mb, disk_mb, tool_parser; [defaults] for every model; [aliases] PATTERN = ID")
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model directory under DIR (one with a config.json) by its folder name")
    p.add_argument("--alias", action="append", default=[], metavar="PATTERN=ID",
                   help="a name clients send, or a glob of them, for a served model (repeatable): 'claude-*haiku*=small' "
                        "'claude-*=main'; the most specific pattern wins; a name nothing matches gets a 404 listing "
                        "what is served")
    p.add_argument("--pin", action="append", default=[], metavar="ID",
                   help="load this model at start and never unload it (repeatable)")
    p.add_argument("--models-mb", type=int, default=None, metavar="MB",
                   help="the most resident memory the server takes: its runtime, the tokenizers loads kept and each "
                        "loaded model's weights, KV pool and working memory, as estimated before a load; a load that "
                        "needs room unloads the least recently used models that are not pinned and serve no request "
                        "(their agents' caches are saved, and come back from disk) (default: no bound)")
    p.add_argument("--idle-ttl", type=float, default=d.idle_ttl_s, metavar="S",
                   help="unload a model no request used for S seconds (pinned ones stay; default 0: never)")
    p.add_argument("--kv-bits", type=int, default=None, choices=(2, 3, 4, 5, 6, 8),
                   help="quantize the KV caches to this many bits (default: the model's dtype)")


def _server_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """Where the server listens, where it keeps caches, and who may call it."""
    p.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port})")
    p.add_argument("--cache-dir", default=None,
                   help="where agent caches are saved; with several models, each under <dir>/<model fingerprint> "
                        "(default: ~/.cache/semantic-kv/agents/<model fingerprint>)")
    p.add_argument("--cache-layout", choices=("blocks", "file"), default=d.cache_layout,
                   help="blocks: each 256-token block written once under its content key, shared by every agent "
                        "that holds it, and a small manifest per agent (default); file: one file per agent, "
                        "rewritten by every save (the old layout, kept to measure against)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"accept this key (repeatable; also ${KEYS_ENV}, comma-separated); none: no auth")


def _memory_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """The budgets: the KV block pool, the caches resident in RAM, the cache files on disk."""
    p.add_argument("--pool-mb", type=int, default=d.pool_mb,
                   help="KV block pool: the most memory all KV caches take together, resident, in flight and "
                        "reusable prefixes (default: sized from the machine's memory and the model, which the "
                        "server logs at start; see docs/serving.md)")
    p.add_argument("--ram-mb", type=int, default=d.ram_mb,
                   help=f"the most memory agents' caches stay resident in between their turns, blocks shared by "
                        f"agents counted once, checked after every step: least recently used caches already on "
                        f"disk are evicted (their next turn loads the file). At most --pool-mb, which also holds "
                        f"turns in flight and reusable prefixes (default {defaults.RAM_SHARE * 100:.0f}%% of the pool)")
    p.add_argument("--disk-mb", type=int, default=d.disk_mb,
                   help=f"disk for saved caches, least recently used files deleted beyond it; a filesystem with less "
                        f"room (free space less a 5%% reserve) stops new saves without deleting any (default: "
                        f"30 GiB or a quarter of the free space, the smaller)")


def _batch_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """How many turns run and wait, and how a long prompt's prefill shares steps with decoding."""
    p.add_argument("--max-batch", type=int, default=d.max_batch, help=f"sequences decoded together (default {d.max_batch})")
    p.add_argument("--max-queued", type=int, default=d.max_queued,
                   help=f"requests waiting before 429 (default {d.max_queued})")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens prefilled per step between decode steps, fixed: smaller keeps other agents' "
                        "streams smoother while a long prompt prefills, larger finishes that prompt sooner "
                        "(default: a step budget: 2048 when nothing decodes, else 64 on a CPU and 512 on a GPU, "
                        "or what --itl-target-ms holds)")
    p.add_argument("--itl-target-ms", type=float, default=None, metavar="MS",
                   help="while agents decode, size each step's prefill chunk online so a step (one token for each "
                        "of them) takes about this long (default: the fixed chunk above)")


def _request_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """How a request is read and answered: its limits, its save, its tools and history."""
    p.add_argument("--max-context", type=int, default=None, help="max prompt + completion tokens (default: the model's)")
    p.add_argument("--max-body-mb", type=float, default=d.max_body_mb, help=f"request body limit (default {d.max_body_mb})")
    p.add_argument("--sync-saves", action="store_true",
                   help="answer a named agent's turn only once its cache is written and fsynced, so a SIGKILL "
                        "right after the reply loses nothing; the reply says saved or failed (X-Semantic-Cache-Save, "
                        "usage.cache_save) (default: saved behind the reply, which says pending)")
    p.add_argument("--tool-parser", default=None, metavar="NAME",
                   help="the model's tool-call format: an mlx_lm.tool_parsers module (json_tools, mistral, "
                        "qwen3_coder, ...) or 'generic' (tools described in the system turn, calls as JSON under a "
                        "grammar); default: what mlx-lm sniffs from the chat template, else generic")
    p.add_argument("--keep-billing-header", action="store_true",
                   help="keep a system block that starts with 'x-anthropic-billing-header:' (Claude Code sends a "
                        "new one with every request, so every turn would miss the cache from its first token)")
    p.add_argument("--no-echo-history", dest="echo_history", action="store_false",
                   help="render every reply a client sends back through the chat template, instead of using the "
                        "tokens this server generated for that agent (the cache then misses from the re-rendered "
                        "reply on; for comparisons)")
    p.add_argument("--strict-max-tokens", action="store_true",
                   help="refuse (400) a max_tokens that does not fit the context after the prompt, as the hosted "
                        "APIs do (default: cut it to what the context leaves, and say so in the "
                        "X-Max-Tokens-Clamped header)")


def _speculation_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """Prompt-lookup drafts for greedy turns."""
    p.add_argument("--no-speculation", dest="speculation", action="store_false",
                   help="decode one token per step: no prompt-lookup drafts (greedy output is the same either way; "
                        "drafts end replies that copy their context sooner)")
    p.add_argument("--spec-max-draft", type=int, default=d.spec_max_draft, metavar="N",
                   help=f"the most tokens a greedy turn drafts from its context per step; how many it does is "
                        f"sized online from its own acceptance rate (default {d.spec_max_draft})")


def _remote_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """The tier shared with other servers (Redis)."""
    p.add_argument("--remote", default=None, metavar="URL",
                   help="a Redis (or Valkey) URL, redis://host:port/db: every saved cache is also published there, "
                        "and an agent's newer cache published by another server of the same model is fetched "
                        "before its turn, so any server resumes any agent (default: this machine only)")
    p.add_argument("--remote-mb", type=int, default=d.remote_mb, metavar="MB",
                   help="the most MiB of this model's caches the shared tier keeps: past it, the agents least "
                        "recently published or fetched are deleted there; give every server the same value "
                        "(default 0: only Redis's own maxmemory bounds it)")


def _lifecycle_flags(p: argparse.ArgumentParser, d: ServeConfig) -> None:
    """Shutdown and logging."""
    p.add_argument("--graceful-timeout", type=float, default=d.graceful_s,
                   help=f"seconds shutdown lets in-flight streams finish before cancelling them (default {d.graceful_s})")
    p.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS)


# in --help order: each adds its flags after the group before it
FLAG_GROUPS = (_model_flags, _server_flags, _memory_flags, _batch_flags, _request_flags, _speculation_flags,
               _remote_flags, _lifecycle_flags)


def parse_config(argv: list[str]) -> ServeConfig:
    """The command line (and ``$SEMANTIC_API_KEYS``) as a checked :class:`ServeConfig`."""
    parser = build_parser()
    a = parser.parse_args(argv)
    env_keys = [k.strip() for k in os.environ.get(KEYS_ENV, "").split(",") if k.strip()]
    try:
        return ServeConfig(
            models=tuple(a.model), model_id=a.model_id, models_file=a.models_file, models_dir=a.models_dir,
            aliases=tuple(a.alias), pins=tuple(a.pin), models_mb=a.models_mb, idle_ttl_s=a.idle_ttl,
            kv_bits=a.kv_bits, host=a.host, port=a.port, cache_dir=a.cache_dir,
            cache_layout=a.cache_layout,
            api_keys=tuple(dict.fromkeys([*a.api_key, *env_keys])), pool_mb=a.pool_mb, ram_mb=a.ram_mb,
            disk_mb=a.disk_mb, max_batch=a.max_batch, max_queued=a.max_queued, max_context=a.max_context,
            prefill_chunk=a.prefill_chunk, itl_target_ms=a.itl_target_ms, max_body_mb=a.max_body_mb, graceful_s=a.graceful_timeout, log_level=a.log_level,
            sync_saves=a.sync_saves, keep_billing_header=a.keep_billing_header, tool_parser=a.tool_parser,
            echo_history=a.echo_history, strict_max_tokens=a.strict_max_tokens, speculation=a.speculation,
            spec_max_draft=a.spec_max_draft, remote=a.remote,
            remote_mb=a.remote_mb)
    except ValueError as exc:
        parser.error(str(exc))  # exits 2 with the usage line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    config = parse_config(argv)

    import semantic.blas

    semantic.blas.enable()  # before anything below imports mlx: its BLAS is fixed at import

    try:
        import uvicorn

        from semantic.serve.app import create_app
    except ImportError as exc:
        print(f"error: {exc.name} is missing; install the server's extra: pip install 'semantic-kv[serve]'",
              file=sys.stderr)
        return 2
    from semantic.serve.opening import fleet_of, pinned
    from semantic.serve.fleet.registry import RegistryError
    from semantic.service import CacheError

    logging.basicConfig(level=config.log_level_number, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("semantic.serve")
    try:
        fleet = fleet_of(config)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        fleet.preload(pinned(fleet))
    except (OSError, ValueError, LookupError, RuntimeError, CacheError) as exc:
        source = next((s.entry.source for s in fleet.slots.values() if s.state != "loaded" and s.entry.options.pinned),
                      config.model)
        print(f"error: cannot load {source!r}: {exc}", file=sys.stderr)
        asyncio.run(fleet.aclose(timeout=config.shutdown_s))
        return 2
    app = create_app(fleet, config)
    log.info("serving %s on http://%s:%d (%s)", ", ".join(fleet.slots), config.host, config.port,
             f"{len(config.api_keys)} API key(s)" if config.api_keys else "no API keys: open to anyone who can connect")
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           lifespan="on", timeout_graceful_shutdown=config.graceful_s))
    _admit_nothing_on_signal(server, fleet, app.state.serve, config.graceful_s)
    try:
        server.run()
    except KeyboardInterrupt:
        return 130
    finally:
        if not app.state.serve.closed:  # uvicorn never reached the lifespan's shutdown (e.g. port in use)
            fleet.begin_shutdown()
            asyncio.run(fleet.aclose(timeout=config.shutdown_s))
    return 0 if server.started else 1


def _admit_nothing_on_signal(server, backend, state, graceful_s: float) -> None:
    """On SIGTERM / SIGINT, stop admitting at once: new requests get 503 during the graceful drain; just
    before the drain's time runs out, the turns still open are ended with a 503 (not a cancelled task's 500)."""
    from semantic.serve.app import abort_turns

    uvicorn_exit = server.handle_exit
    log = logging.getLogger("semantic.serve")

    def abort() -> None:
        if n := abort_turns(state):
            log.warning("--graceful-timeout %.1f s ran out: %d open turn(s) answered 503 and cancelled", graceful_s, n)

    def stop(loop) -> None:
        backend.begin_shutdown()
        loop.call_later(max(0.0, graceful_s - ABORT_MARGIN_S), abort)

    def handle_exit(sig, frame) -> None:
        try:  # from the loop, not in the signal handler: begin_shutdown may take a lock this thread holds
            loop = asyncio.get_running_loop()
            loop.call_soon_threadsafe(stop, loop)
        except RuntimeError:
            pass
        uvicorn_exit(sig, frame)

    server.handle_exit = handle_exit  # capture_signals installs self.handle_exit
