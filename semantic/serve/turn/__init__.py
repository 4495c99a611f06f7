"""One turn, the same for every API: the one request type (``apirequest``), the conversation form
(``conversation``), the service bridged to asyncio (``backend``) and the relay that runs a turn (``turn``)."""
