"""refusion-bench harness: lm-eval adapter, runner, results store, reporting.

Importing this package is cheap and offline: heavy dependencies (torch,
transformers, lm_eval) are imported inside the modules that need them.
"""

__version__ = "0.1.0"
