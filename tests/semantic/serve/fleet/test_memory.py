"""An unloaded model's memory goes back to the system (``semantic.serve.fleet.memory``): an unload collects
until what held the model is gone."""

from __future__ import annotations

from semantic.serve.fleet.memory import holders, release


def test_release_collects_a_cycle_a_thread_still_held_when_the_unload_began():
    """An unload's first collection may run while the thread that closed the service still holds it; release
    collects again until what held the model's memory is gone (a bounded poll), then says whether it is."""
    import threading

    class Model:  # a model and its engine in a reference cycle, as a closed scheduler leaves them
        def __init__(self):
            self.engine = {"model": self}

    model = Model()
    held = [w for w in holders(_Backend(model))]
    go = threading.Event()
    holder = threading.Thread(target=lambda m=model: go.wait(10) and m is not None)  # keeps it until go is set
    holder.start()
    del model
    threading.Timer(0.1, go.set).start()
    assert release(held, wait_s=10)
    holder.join(10)
    assert held[0]() is None

    stuck = Model()
    assert not release(holders(_Backend(stuck)), wait_s=0.05)  # still referenced: said, not waited for forever


class _Backend:
    def __init__(self, model):
        self.model = model

    def holders(self) -> list:
        return [self.model]
