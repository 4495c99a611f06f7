"""EXP-006: reconstruction and extraction cost. ``trial`` (the kind and its cells), ``report`` (the
cells' summaries).
"""
