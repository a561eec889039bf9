"""lm-eval's own command line with the ``refusion_bench`` model registered.

lm-eval 0.4.13 finds models only in its built-in table (it reads no plugin entry
points), so a model defined outside the package must be imported before the
CLI parses ``--model``. This module does exactly that and hands over:

    python -m harness.lm_eval_cli run --model refusion_bench \\
        --model_args pretrained=checkpoints/tiny/refusion,decoder=refusion,slot_size=8 \\
        --tasks embedded --include_path tasks --apply_chat_template --confirm_run_unsafe_code --limit 10

``--confirm_run_unsafe_code`` is lm-eval's consent for tasks that execute the model's programs
(``embedded_code``, ``humaneval_instruct``, ``mbpp``: here in ``tasks.sandbox``); without it lm-eval
refuses them, which this wrapper reports as one ``error:`` line instead of a traceback.

Every lm-eval option works as documented by ``lm-eval run --help``; data-parallel
runs go through ``accelerate launch --multi_gpu --num_processes N -m harness.lm_eval_cli run ...``
(``--multi_gpu`` selects accelerate's multi-process launcher; on a machine without
GPUs the adapter joins a CPU/gloo process group).
"""

from __future__ import annotations

import sys

import harness.run.lm_adapter  # noqa: F401  (registers the model under its name)


UNSAFE_HINT = "marked as unsafe"


def main() -> int:
    from lm_eval.__main__ import cli_evaluate

    from harness.run.quiet import quiet_libraries

    quiet_libraries()
    try:
        cli_evaluate()
    except ValueError as e:
        if UNSAFE_HINT not in str(e):
            raise
        task = str(e).split("task:", 1)[-1].split(" which", 1)[0].strip() or "a task"
        print(f"error: {task} executes generated code (in tasks/sandbox); add --confirm_run_unsafe_code to "
              "allow it", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
