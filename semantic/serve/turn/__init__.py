"""One turn, the same for every API: the one request type (``request``), the conversation form
(``conversation``), the service bridged to asyncio (``backend``) and the relay that runs a turn (``turn``)."""
