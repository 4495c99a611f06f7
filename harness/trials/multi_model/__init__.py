"""EXP-019's parts (``harness.trials.multi_model.trial``): several models behind one ``semantic serve`` (issue 40).

``servers`` starts the fleet server (``--model ID=DIR`` per model, ``--models-mb``), a server of one model,
and ``mlx_lm.server``; ``client`` sends one streamed greedy turn and times it at the client; ``sampler``
reads a server's RSS and its ``fleet`` stats every ~100 ms; ``switching`` and ``concurrent`` are the two
measured phases; ``report`` turns their rows into checks and the README (pure).
"""
