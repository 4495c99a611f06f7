"""``semantic serve``: an OpenAI- and Anthropic-compatible HTTP server over the engine.

The HTTP layer (``app``, one folder per API: ``openai``, ``anthropic``, ``responses``;
``metrics``, ``dashboard``) parses and validates at the edge and hands
:mod:`semantic.serve.turn.backend` token ids and sampling settings; nothing below
it knows about HTTP. Importing this package imports nothing heavy: ``cli``
points MLX at a fast BLAS before anything loads ``mlx``.
"""
