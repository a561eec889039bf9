"""Training: the tiny-suite training entry point, learning curves and the result-digit probe.

Imports ``harness.run`` and ``harness.models``, never ``report`` or ``speed`` (tests/test_layering.py).
"""
