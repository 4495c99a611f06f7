"""What a server's memory does: drivers that measure RSS, each in a process of its own.

``cycles`` switches two models in one fleet and samples RSS (the fleet's memory test runs it);
``costs`` measures the constants of ``semantic.serve.fleet.footprint``. They live outside
``harness.trials``, whose own imports (every experiment's) add 150 MB to the RSS they would measure.
"""
