"""The dashboard page (``/`` and ``/dashboard``) and the JSON it polls (``/v1/cache/stats``).

The page is one static file, no build step and no external URLs; it reads
``/v1/cache/stats`` every 2 s with the key the user typed (kept in
localStorage), so the page itself is open and its data is not.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from semantic.serve.errors import NOT_FOUND, ApiError
from semantic.serve.fleet.fleet import LOADED, ModelNotFoundError
from semantic.serve.state import ServeState, serve_state, tenant_of

router = APIRouter()


@lru_cache(maxsize=1)
def page() -> str:
    return resources.files("semantic.serve").joinpath("static/dashboard.html").read_text(encoding="utf-8")


@router.get("/", include_in_schema=False)
@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return HTMLResponse(page())


@router.get("/v1/cache/stats")
def cache_stats(request: Request, model: str | None = None, state: ServeState = Depends(serve_state)) -> Response:
    """``backend.stats()`` of ``model`` (default: the first served) for the caller's tenant (all of them without
    keys), with every served model's row (``models``) and the memory they share (``fleet``). A model not loaded
    now has its name and state only.

    A plain ``def``: FastAPI runs it on a worker thread, so stats() waiting on
    the service's locks never stalls the event loop (and every stream with it).
    """
    fleet = state.models
    try:
        slot = fleet.slot(model)
    except ModelNotFoundError as exc:
        raise ApiError(NOT_FOUND, str(exc), param="model", code="model_not_found") from None
    backend = slot.backend  # read once: an unload may run meanwhile on the loop
    backend = backend if slot.state == LOADED else None
    out = backend.stats(tenant_of(request) or None) if backend is not None else {"model": slot.id}
    out.update(state=slot.state, models=fleet.rows(), fleet=fleet.summary())
    return JSONResponse(out)
