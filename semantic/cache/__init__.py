"""The KV cache in RAM: a model's cache geometry, 256-token blocks, the pool that holds them.

``spec`` says what a model's cache is made of; ``blocks`` and ``pool`` hold it
in hash-chained blocks; ``blockclaim`` and ``convert`` move a cache between a
model's cache objects and blocks, exactly; ``reuse`` finds what a new prompt
can resume from; ``snapshots`` says where a prefill stops to take a snapshot (the snapshot positions); ``manager`` is the
executor's one door to all of them (``CacheManager``: a turn's start, rebuild, carried snapshots, passed
window blocks, extraction).
"""
