"""lm-eval's own command line with the ``refusion_bench`` model registered.

lm-eval 0.4.13 finds models only in its built-in table (it reads no plugin entry
points), so a model defined outside the package must be imported before the
CLI parses ``--model``. This module does exactly that and hands over:

    python -m harness.lm_eval_cli run --model refusion_bench \\
        --model_args pretrained=checkpoints/tiny/refusion,decoder=refusion,slot_size=8 \\
        --tasks embedded --include_path tasks --apply_chat_template --limit 10

Every lm-eval option works as documented by ``lm-eval run --help``; data-parallel
runs go through ``accelerate launch --multi_gpu --num_processes N -m harness.lm_eval_cli run ...``
(``--multi_gpu`` selects accelerate's multi-process launcher; on a machine without
GPUs the adapter joins a CPU/gloo process group).
"""

from __future__ import annotations

import harness.lm_adapter  # noqa: F401  (registers the model under its name)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
