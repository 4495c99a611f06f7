"""The served models: which names reach them (``registry``), what to unload for a load (``unloads``, plain data),
the fleet that loads, leases and unloads them (``fleet``) and how it shows them (``view``)."""
