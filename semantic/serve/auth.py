"""API keys: who may call, and which tenant a caller's caches belong to.

A tenant is a stable, non-reversible id of the caller's key (a sha256
prefix), so cache files and stats never hold a key. Without keys every
caller is tenant ``""`` and nothing is checked.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from semantic.serve.errors import AUTH, ApiError, error_response

# Open even when keys are set: liveness probes and the dashboard's page (its data needs a key).
OPEN_PATHS = frozenset({"/health", "/", "/dashboard"})


def tenant_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def presented_key(headers: Headers) -> str | None:
    """The key from ``Authorization: Bearer KEY`` or ``x-api-key: KEY``."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


class Keys:
    """The accepted keys; :meth:`tenant_of` compares in constant time per key."""

    def __init__(self, keys: tuple[str, ...] | list[str]):
        self._keys = [(k.encode(), tenant_id(k)) for k in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def tenant_of(self, key: str | None) -> str | None:
        """The key's tenant, or None when it is not an accepted key."""
        if key is None:
            return None
        given, found = key.encode(), None
        for k, tenant in self._keys:  # no early exit: the time does not say which key matched
            if hmac.compare_digest(given, k):
                found = tenant
        return found


class AuthMiddleware:
    """ASGI middleware: 401 without an accepted key; sets ``request.state.tenant``."""

    def __init__(self, app: ASGIApp, keys: Keys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tenant = ""
        if self.keys and scope["path"] not in OPEN_PATHS:
            tenant = self.keys.tenant_of(presented_key(Headers(scope=scope)))
            if tenant is None:
                err = ApiError(AUTH, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await error_response(scope["path"], err)(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
