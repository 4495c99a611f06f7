"""EXP-005: a cache saved in one process continues in another. ``trial`` (the kind), ``speed`` (save
and load timing), ``child`` (the fresh process that loads the file).
"""
