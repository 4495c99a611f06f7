"""EXP-017's pieces (the kind is ``harness.trials.block_store.trial``): write each block once, measured from the client.

- ``measure``: pure arithmetic and readings: ``/proc/<pid>/io``, KV bytes per token from
  ``/v1/cache/stats``, write amplification, a cache directory's bytes, ratios of medians;
- ``servers``: one ``semantic serve`` per store layout (``--cache-layout``), started, restarted and
  waited on until idle, their cache files evicted from the page cache before a restart;
- ``disk_phases`` and ``time_phases``: the four measurements (write amplification, shared prompt on disk, restart TTFT,
  a cached turn beside another agent's save), each layout interleaved with the other;
- ``checks``: the checks from the phases' rows. The turn itself is ``harness.servers.client``.
"""
