"""EXP-009: servers side by side. ``trial`` (the kind), ``report`` (records as metrics, checks, plots),
``aiperf`` (the same servers under NVIDIA's AIPerf), ``append_profile`` (where a long append's time
goes); the servers, client and phases are ``harness.servers``.
"""
