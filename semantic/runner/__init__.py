"""The batch executor: one step loop runs every sequence, with pooled caches in and out.

``executor`` takes requests with their reused blocks, runs them in one
``steploop`` (a decode token for every generating sequence, then a prefill
chunk sized by ``stepbudget``) and hands each finished cache back as blocks;
``batchprobe`` finds out once which cache kinds this mlx-lm can batch.
"""
