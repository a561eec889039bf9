"""Speed: the decoder, kernel and end-to-end benchmarks and the CI regression check.

Imports ``harness.run`` and ``harness.models``, never ``report`` or ``train`` (tests/test_layering.py).
"""
