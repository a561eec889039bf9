"""The request piece of the lm-eval model (``harness/run/lm_adapter.py``): what one lm-eval request asks
of the decoder. Knobs by precedence (the checkpoint's own < the task's defaults < ``model_args``), the
journal key, the stop strings, and the grouping of requests with equal knobs into decoder batches."""

from __future__ import annotations

from typing import Any

from harness.run.store import request_key

# The response budget of a generate_until request that sets no max_gen_toks (lm-eval's own default).
DEFAULT_MAX_GEN_TOKS = 256


class RequestPlan:
    """Knobs and journal key of each ``generate_until`` request for one decoder and checkpoint.

    ``knobs``: the model's knobs as given (they key the journal; the decoder fills in defaults);
    ``task_knobs``: task -> that task's decoding defaults; ``checkpoint_knobs``: what the checkpoint
    sets for itself (lm_adapter.checkpoint_knobs); ``knob_names``: the decoder's knobs."""

    def __init__(self, decoder_name: str, knob_names: set[str], checkpoint_knobs: dict[str, Any],
                 task_knobs: dict[str, dict[str, Any]] | None, knobs: dict[str, Any], seed: int) -> None:
        self.decoder_name, self.knob_names, self.seed = decoder_name, knob_names, seed
        self.checkpoint_knobs = checkpoint_knobs
        self.task_knobs = {t: dict(v) for t, v in (task_knobs or {}).items()}
        self.knobs = dict(knobs)

    def knobs_for(self, task: str | None, gen_kwargs: dict) -> dict[str, Any]:
        """Effective knobs of one request: the checkpoint's defaults < task defaults < model_args; gen_length
        falls back to max_gen_toks."""
        k = {**self.checkpoint_knobs, **self.task_knobs.get(task or "", {}), **self.knobs}
        if "gen_length" in self.knob_names and "gen_length" not in k:
            k["gen_length"] = int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if "seed" in self.knob_names and "seed" not in k:
            k["seed"] = self.seed
        return k

    def prepare(self, req) -> dict:
        """One ``generate_until`` request as the decoder call takes it: key, context, stop strings, knobs."""
        context, gen_kwargs = req.args
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        knobs = self.knobs_for(req.task_name, gen_kwargs)
        key = request_key("generate_until", req.task_name, req.doc_id, context,
                          {k: v for k, v in gen_kwargs.items()}, self.decoder_name, knobs)
        return {"key": key, "context": context, "until": until, "knobs": knobs, "task": req.task_name,
                "doc_id": req.doc_id, "idx": req.idx}


def group(todo: list[tuple[int, dict]], batch_size: int) -> list[list[tuple[int, dict]]]:
    """Consecutive prepared requests with equal knobs, at most ``batch_size`` a batch, in request order."""
    batches: list[list[tuple[int, dict]]] = []
    for i, it in todo:
        last = batches[-1] if batches else None
        if last and len(last) < batch_size and last[0][1]["knobs"] == it["knobs"]:
            last.append((i, it))
        else:
            batches.append([(i, it)])
    return batches


def loglikelihood_key(req, causal: bool, mc_num: int, seed: int) -> str:
    """Journal key of one ``loglikelihood`` request."""
    context, continuation = req.args
    return request_key("loglikelihood", req.task_name, req.doc_id, context, continuation, causal, mc_num, seed)
