"""What every route reaches through ``request.app.state.serve``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from semantic.serve.config import ServeConfig
from semantic.serve.metrics import ServeMetrics

if TYPE_CHECKING:
    from semantic.serve.fleet.fleet import Fleet


@dataclass(slots=True)
class ServeState:
    models: "Fleet"
    config: ServeConfig
    metrics: ServeMetrics
    started: int = field(default_factory=lambda: int(time.time()))  # unix seconds, for /v1/models
    closed: bool = False  # the backend's aclose() finished
    turns: set = field(default_factory=set)  # Turns not yet closed: shutdown lets them close first
    # stored responses (previous_response_id) beside the caches: the Responses API's ResponseStore, which it
    # imports itself, as every route imports this module
    responses: object = None

    @property
    def backend(self):
        """The default model's backend while it is loaded (one model: always)."""
        return self.models.backend_of(None)


def serve_state(request: Request) -> ServeState:
    """FastAPI dependency: the app's :class:`ServeState`."""
    return request.app.state.serve


def tenant_of(request: Request) -> str:
    """The caller's tenant, set by the auth middleware ("" without keys)."""
    return getattr(request.state, "tenant", "")
