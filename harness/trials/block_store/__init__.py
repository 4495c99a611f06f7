"""EXP-017's pieces (the kind is ``harness.trials.block_store.trial``): write each block once, measured from the client.

- ``measure``: pure arithmetic and readings: ``/proc/<pid>/io``, KV bytes per token from
  ``/v1/cache/stats``, write amplification, a cache directory's bytes, ratios of medians;
- ``servers``: one ``semantic serve`` per store layout (``--cache-layout``), started, restarted and
  waited on until idle, their cache files evicted from the page cache before a restart;
- ``client``: one streamed greedy turn through the ``openai`` SDK, timed at the client;
- ``phases``: the four measurements (write amplification, shared prompt on disk, restart TTFT,
  a cached turn beside another agent's save), each layout interleaved with the other.
"""
