"""What a submitted turn gives back: a future that answers twice.

A turn's ``tokens`` future resolves as soon as its last token is read, with
everything a client is told (the tokens, the finish reason, the cached and
prompt counts); the future itself resolves once the cache is extracted
and its save prepared, in the same step. The agent's next
turn waits for the second: it always starts from the whole cache of the one
before (``semantic.sched.scheduler``).
"""

from __future__ import annotations

from concurrent.futures import Future

from semantic.request import Completion

TurnResult = Completion  # what a turn's future gives: the executor's Completion, its blocks kept by the scheduler


class TurnFuture(Future):
    """A turn's Completion once its cache is kept; ``tokens`` resolves sooner, as soon as its last token is
    read, with a Completion of the same tokens and counts and no blocks (the cache is not complete yet)."""

    def __init__(self):
        super().__init__()
        self.tokens: Future = Future()

    def answer(self, result: Completion | None = None, exc: BaseException | None = None) -> None:
        """Resolve both futures (``tokens`` first, unless it already was), with ``result`` or ``exc``.

        Args:
            result: the Completion both give, when the turn has one.
            exc: the error both raise instead.
        """
        for f in (self.tokens, self):
            if f.done():
                continue
            if exc is not None:
                f.set_exception(exc)
            else:
                f.set_result(result)
