"""A reply as it streams: the executor's tokens as text (``text``), split into reasoning (``thinking``) and tool
calls (``toolcalls``), and written to the client as server-sent events (``sse``)."""
