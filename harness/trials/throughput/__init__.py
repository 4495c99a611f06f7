"""Prefill and decode throughput per BLAS. ``trial`` (the kind), ``child`` (one process per BLAS).
"""
