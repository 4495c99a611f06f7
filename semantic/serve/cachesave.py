"""The one field of ours every API's usage carries: what became of a named agent's save."""

from __future__ import annotations

from pydantic import BaseModel, model_serializer


class CacheSaveUsage(BaseModel):
    """``cache_save``: a named agent's "saved", "pending" or "failed" (``semantic.service``'s outcomes); absent
    from the JSON for an anonymous turn, so clients that know nothing of it see the API's own usage."""

    cache_save: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_save(self, handler):
        out = handler(self)
        if out.get("cache_save") is None:
            out.pop("cache_save", None)
        return out
