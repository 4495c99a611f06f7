"""EXP-020's pieces (the kind is ``harness.trials.real_geometry.trial``): real models' caches at real lengths.

- ``models``: tiny-body random bfloat16 models whose caches have real models' bytes per token, as directories
  ``mlx_lm.load`` reads, kept under ``~/.cache/semantic-kv/models``;
- ``synthetic``: a long agent's cache written without a prefill (random K/V of the real shapes, through the store);
- ``floors``: what the hardware does with the same bytes (sequential read and write, memcpy);
- ``inproc``: our save and restore beside mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache``, in process;
- ``serving``: ``semantic serve`` on the synthetic agent, timed from the client;
- ``report``: the checks, metrics and README.
"""
