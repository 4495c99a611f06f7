"""What a server's memory does: drivers that measure RSS, each in a process of its own.

``cycles`` switches two models in one fleet and samples RSS. It lives outside ``harness.trials``, whose own
imports (every experiment's) add 150 MB to the RSS it would measure.
"""
