"""How many copies of an agent's cache a server holds, from outside the process."""
