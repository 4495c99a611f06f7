"""Agents' caches on disk (``agentstore``: :class:`AgentCacheStore`) and on a tier shared with other servers."""

from semantic.store.agentindex import EXTRA_SUFFIX, file_name
from semantic.store.agentstore import LAYOUTS, AgentCacheStore, StoreStats
from semantic.store.blocklayout import PREFIX
from semantic.store.manifest import manifest_name
from semantic.store.quarantine import QUARANTINE_DIR, Quarantined

__all__ = ["EXTRA_SUFFIX", "LAYOUTS", "PREFIX", "manifest_name", "QUARANTINE_DIR", "AgentCacheStore", "Quarantined", "StoreStats",
           "file_name"]
