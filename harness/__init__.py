"""refusion-bench harness, in five sub-packages that import one way down (tests/test_layering.py):

    speed/   decoder, kernel and end-to-end benchmarks; the CI regression check
    report/  the paper's Table 1 report, figures, run sets, compare, the knob sweep, decode traces
    train/   the tiny-suite training entry point, learning curves, the result-digit probe
      -> run/     `harness eval`: runner, worker, the lm-eval model, results store, metrics, presets, knobs
        -> models/  the model-family table, checkpoint inspection and loading

The entry points sit on top: cli.py (`python -m harness <command>`) and lm_eval_cli.py (lm-eval's own CLI
with the ``refusion_bench`` model registered).

Importing this package is cheap and offline: heavy dependencies (torch,
transformers, lm_eval) are imported inside the modules that need them.
"""

__version__ = "0.1.0"
