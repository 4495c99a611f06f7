"""What the trials share that is no server: their child processes (``children``), and the pieces of
their results READMEs (``report``: numbers as the tables print them, the verdict table, medians)."""
