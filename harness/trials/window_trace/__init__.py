"""EXP-021: a sliding-window model on a coding-agent trace against ``mlx_lm.server``.

``trace``: the agents' turns over HTTP to servers taking turns; ``profile``: one append turn's spans in
this process; ``report``: the checks and the README.
"""
