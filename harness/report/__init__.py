"""Reading runs: the paper's Table 1 report, figures, run sets, compare, the knob sweep, the frontier with its
AUP (`make frontier`) and decode traces.

Imports ``harness.run`` and ``harness.models``, never ``speed`` or ``train`` (tests/test_layering.py).
"""
