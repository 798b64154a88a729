"""The conformance checks by area, one module each; ``conformance.suite`` gathers them for pytest.

Module names do not start with ``test_``: pytest collects the checks once, from the suite.
"""
