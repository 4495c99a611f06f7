"""Servers side by side (EXP-009, issue 16): ours and its peers as config, each started the same way.

``targets`` holds one :class:`~harness.serving.targets.ServerTarget` per
server (install recipe, start command, readiness probe, where it reports
cache hits), installs a peer into its own git-ignored venv under ``.peers/``,
and starts and stops a server as a subprocess on 127.0.0.1 with the same
system OpenBLAS as ours.
"""
