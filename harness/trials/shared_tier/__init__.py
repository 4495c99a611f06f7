"""EXP-016: servers sharing a Redis tier. ``trial`` (the kind), ``redis_server`` (the Redis process).
"""
