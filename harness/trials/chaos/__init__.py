"""EXP-015's chaos soak: one ``semantic serve`` under faults, many agents, and what must still hold.

- :mod:`harness.servers.ours`: the server as a process we kill, stop and start again on one port;
- :mod:`harness.trials.chaos.fs`: the cache filesystem (a size-limited tmpfs): fill it, make it read-only,
  corrupt a file in it;
- :mod:`harness.trials.chaos.agents`: agents talking through the official SDKs, each request's outcome;
- :mod:`harness.trials.chaos.ledger`: every request and fault recorded, the durability check, the counts;
- :mod:`harness.trials.chaos.injector`: the seeded fault plan and its execution;
- :mod:`harness.trials.chaos.checks`: what the record says against each goal (the checks of the results);
- :mod:`harness.trials.chaos.timeline`: the plot of faults, TTFT and RSS over the run.

The kind that runs it all is :mod:`harness.trials.chaos.trial`.
"""
