"""``create_app(backend, config)``: the FastAPI app, its middlewares, routes and lifespan.

Middlewares, outermost first (each refuses before the next runs)::

    MetricsMiddleware  count and time every request, whatever answered it
    CatchAll           anything that escapes → logged, generic 500 in the API's shape
    AuthMiddleware     401 without a key (when keys are set); sets the tenant
    ClosingGate        503 once shutdown began, and for a request cancelled by its end
    BodyLimit          413 over --max-body-mb
    Leases             the models a request holds are released when its answer (a stream: its end) is sent
    (FastAPI)          exception handlers → errors.install
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI
from starlette.responses import Response

from semantic.serve import dashboard, errors
from semantic.serve.anthropic.router import router as anthropic_routes
from semantic.serve.openai.router import router as openai_routes
from semantic.serve.responses.router import router as responses_routes
from semantic.serve.responses.store import ResponseStore
from semantic.serve.auth import AuthMiddleware, Keys
from semantic.serve.config import ServeConfig
from semantic.serve.fleet.fleet import Fleet
from semantic.serve.gates import BodyLimit, ClosingGate, Leases
from semantic.serve.metrics import CONTENT_TYPE, MetricsMiddleware, ServeMetrics
from semantic.serve.state import ServeState, serve_state
from semantic.service import SchedulerClosedError

if TYPE_CHECKING:
    from semantic.serve.turn.backend import Backend

CANCEL_WAIT_S = 2.0


def abort_turns(state: ServeState) -> int:
    """End every open turn with a 503 (a stream: its error event), as shutdown's grace runs out: uvicorn
    would cancel their tasks next, and a task cancelled before it answers becomes a bare 500."""
    turns = list(state.turns)
    for turn in turns:
        turn.abort(SchedulerClosedError("the server is shutting down and its --graceful-timeout ran out: "
                                        "this turn was cancelled; retry it once the server is back"))
    return len(turns)


def create_app(models: "Fleet | Backend", config: ServeConfig | None = None) -> FastAPI:
    """The server's ASGI app over ``models``.

    Args:
        models: the served models (a ``semantic.serve.fleet.fleet.Fleet``), or one backend
            (``semantic.serve.turn.backend.Backend`` or a stand-in with its interface), served alone.
        config: keys, body limit and shutdown bounds; default: no keys, 4 MiB bodies.

    Returns:
        A FastAPI app whose lifespan starts the fleet's TTL reaper and, at shutdown, stops admitting
        (``begin_shutdown``) and then awaits ``aclose`` of every loaded model.
    """
    fleet = models if isinstance(models, Fleet) else Fleet.of(models)
    config = config or ServeConfig(model=fleet.default)
    responses = fleet.responses_dir or fleet.backend_of(None).responses_dir
    state = ServeState(models=fleet, config=config, metrics=ServeMetrics(fleet), responses=ResponseStore(responses))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        fleet.start()
        yield
        fleet.begin_shutdown()
        # uvicorn cancels the streams still running after its graceful timeout but does not
        # wait for them: let them close their backend streams before the backend closes
        deadline = time.monotonic() + CANCEL_WAIT_S
        while state.turns and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await fleet.aclose(timeout=config.shutdown_s)
        state.closed = True

    app = FastAPI(title="semantic serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serve = state
    errors.install(app)
    for router in (openai_routes, anthropic_routes, responses_routes, dashboard.router):
        app.include_router(router)

    @app.get("/metrics", include_in_schema=False)
    def metrics(s: ServeState = Depends(serve_state)) -> Response:  # a thread: the scrape calls stats()
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    # add_middleware puts each one outside the ones added before it
    app.add_middleware(Leases)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(ClosingGate, closing=lambda: fleet.closing)
    app.add_middleware(AuthMiddleware, keys=Keys(config.api_keys))
    app.add_middleware(errors.CatchAll)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    return app
