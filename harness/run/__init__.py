"""Running decoders: ``harness eval`` (runner, worker), the lm-eval model ``refusion_bench``, the results
store, per-run metrics and summary with their 95% intervals and paired tests (stats), presets and knobs, and
the plain ``model.generate`` reference.

Imports ``harness.models`` only, never a floor above (tests/test_layering.py).
"""
