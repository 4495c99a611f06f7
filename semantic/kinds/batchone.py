"""A ``BatchKVCache`` of one sequence, made over that sequence's own K/V buffers.

mlx-lm's ``BatchKVCache.merge`` copies every row into a new buffer sized exactly to the longest, so
the first decode step grows it again: a turn decoding alone paid two copies of its whole cache to
become a batch. A batch of one needs no padding, so this one takes the row's buffers as they are,
spare slots included, and the decode writes there in place::

    KVCache            keys [t0 .. t_{n-1} | spare ]   offset n
    BatchOneKVCache    keys  (the same array)          _idx n, left_padding [0], offset [n]

Leaving hands the pool the row over the same buffers (one unpadded row): the pool copies only the
blocks it lacks (a resumed turn's new tokens; its history's blocks are already pooled), and a first
turn's buffer is adopted whole or copied exactly, by how much spare it holds (``lending.SPARE_SHARE``),
where mlx-lm's ``extract`` copied the whole row first. A second row joins through mlx-lm's
``extend`` (a copy, as before). MLX never writes into a buffer another array still holds: while
anything else holds the sequence's old buffer, the first write copies it, which is what merge did.
"""

from __future__ import annotations

from mlx_lm.models import cache as C

# what a KVCache over a lent segment's buffers carries (``convert.reconstruct``): widen(keep, slots) gives
# the segment's layer room for ``slots`` tokens, its first ``keep`` kept, and returns its new (keys, values)
WIDEN = "semantic_widen"


class BatchOneKVCache(C.BatchKVCache):
    """mlx-lm's ``BatchKVCache``, made from one ``KVCache`` without a copy (module doc)."""

    widen = None  # when its buffers are the pool's (``lending.Loan``): how to give them more room there
    _lent = None  # the pool's keys array it writes into; a batch another row joined (a copy) no longer does

    @classmethod
    def wrap(cls, cache: C.KVCache) -> "BatchOneKVCache":
        """A batch of the one sequence ``cache`` holds, over its own buffers."""
        batch = cls([0])
        if cache.keys is not None and cache.offset:
            batch.keys, batch.values = cache.keys, cache.values
            batch.offset = batch.offset + cache.offset
            batch._idx = cache.offset
            batch.widen = getattr(cache, WIDEN, None)
            batch._lent = cache.keys if batch.widen is not None else None
        return batch

    def update_and_fetch(self, keys, values):
        """mlx-lm's, but a decode that outgrows the pool's lent buffer widens it there (``lending.widen``):
        mlx-lm's growth would copy the layer beside the pool's, 256 slots at a time."""
        if self.widen is not None and self.keys is self._lent and self._idx + keys.shape[2] > self.keys.shape[2]:
            self.keys = self.values = self._lent = None  # the old buffers go as the segment's do
            self.keys, self.values = self.widen(self._idx, self._idx + keys.shape[2])
            self._lent = self.keys
        return super().update_and_fetch(keys, values)

    def extract(self, idx: int) -> C.KVCache:
        """Row ``idx`` as a ``KVCache``: over the same buffers when it is the only row and unpadded (module
        doc), else mlx-lm's copy of exactly the row."""
        if self.keys is None or self.keys.shape[0] != 1 or self._idx == 0 or int(self.left_padding[0].item()):
            return super().extract(idx)
        cache = C.KVCache()
        # the same array objects: a turn lent the pool's buffers (``lending.Loan``) leaves in them, which
        # the pool recognises; a batch that writes on only appends past the row's tokens
        cache.keys, cache.values, cache.offset = self.keys, self.values, self._idx
        return cache
