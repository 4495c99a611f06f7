"""EXP-007: multi-turn agents through the scheduler. ``trial`` (the kind), ``child`` (the restart from
cache files in a fresh process).
"""
