"""The servers trials start and drive: ours and its peers as config, each started the same way.

    venv = venvs.ensure_venv(TARGETS["vllm-mlx"])           # once; .peers/vllm-mlx/
    with processes.start(TARGETS["vllm-mlx"], model_dir, processes.free_port(), workdir,
                         python=venv.python) as srv:
        before = srv.stats(); ...chat request...; after = srv.stats()
        hits = cache_hits.cached_tokens(srv, usage, before, after)

- ``targets``: one :class:`~harness.servers.targets.ServerTarget` per server
  (install recipe, start command, readiness probe, where it reports cache hits);
- ``venvs``: a peer installed into its own git-ignored venv under ``.peers/``;
- ``processes``: a server started and stopped as a subprocess on 127.0.0.1,
  and its resident memory;
- ``blas``: the same system OpenBLAS as ours for every server;
- ``cache_hits``: the prompt tokens a request took from a server's cache;
- ``ours``: ``semantic serve`` from this checkout, on one port across restarts and kills;
- ``client``: one streamed greedy turn through the ``openai`` SDK, timed at the client;
- ``loadgen`` and ``phases``: the client and the workload, servers taking turns.

EXP-009's report and AIPerf run are ``harness.trials.serving``.
"""
