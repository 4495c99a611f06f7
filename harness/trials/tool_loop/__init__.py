"""EXP-011: tool loops through the SDKs. ``trial`` (the kind, its decode measurement), ``loops`` (the
Agents SDK, openai and anthropic loops).
"""
