"""EXP-018: hybrid recurrent models (and a short sliding window) served by ours against the peers.

``model``: random-weight model directories at real small geometries with a real tokenizer;
``sizes``: snapshot bytes of big real geometries from their configs, and their save / restore
time through the block store; ``turns``: the workload's turn types and their checks.
"""
