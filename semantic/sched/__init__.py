"""The scheduler: which turn runs when, where its cache comes from, and when it is saved.

``scheduler`` runs one worker thread over the executor; ``planner`` decides
each turn's admission and reuse as a plain plan; ``origin`` says where a
cache comes from (the pool, the disk, the shared tier); ``residency`` and
``residentview`` track which agents' blocks stay in RAM; ``saves`` and
``writebehind`` write finished caches to disk behind the replies;
``turnfuture`` is what a caller waits on.
"""
