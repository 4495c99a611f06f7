"""EXP-012: Claude Code against the servers. ``trial`` (one model), ``two_models`` (main and small
model), ``session`` (the client, installed and run), ``proxy`` (what the client saw),
``model_routes`` (which model each request named).
"""
