"""What the trials share that is no server: their child processes (``children``)."""
