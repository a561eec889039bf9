"""Library output a harness user cannot act on, switched off where a model is loaded and evaluated.

Two messages repeat once per model x task of a run and say nothing about it:

- lm-eval's two-line "<task>: Custom kwargs can be passed to `--metadata` ..." warning, logged
  whenever a task loads its data through the ``custom_dataset`` hook (every task of this project
  does, tasks/README.md);
- transformers' "Loading weights" progress bar (a fraction of a second for every checkpoint).

Only those go: the lm-eval logger keeps every other warning and error, transformers keeps its
logging, and the decoders' own progress bar (harness/run/lm_adapter.py) is a plain tqdm, untouched.
"""

from __future__ import annotations

import logging

METADATA_HINT = "Custom kwargs can be passed to `--metadata`"


class DropMetadataHint(logging.Filter):
    """Drops lm-eval's custom_dataset hint; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return METADATA_HINT not in record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format is not ours to drop
            return True


def quiet_libraries() -> None:
    """Install the filter on lm-eval's task logger and turn off transformers' progress bars (idempotent)."""
    task_logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, DropMetadataHint) for f in task_logger.filters):
        task_logger.addFilter(DropMetadataHint())
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    # The "Loading weights" bar (and huggingface_hub's download bars, which an offline run never
    # shows); transformers' warnings stay on.
    hf_logging.disable_progress_bar()
