"""The lm-eval model ``refusion_bench``: a Hugging Face checkpoint folder driven by a decoder from
``refusion.decoding``.

Thin by design: text goes in, the chat template and tokenizer turn it into ids,
the decoder registry turns ids into ids, and the tokenizer turns them back into
text cut at the task's stop strings. No decoding logic lives here.

    lm = RefusionBenchLM(pretrained="checkpoints/tiny/refusion", decoder="refusion", slot_size=8)
    lm_eval.simple_evaluate(model=lm, tasks=[...], apply_chat_template=True)

``model_args`` that are not adapter options below are decoder knobs
(``pretrained=DIR,decoder=refusion,slot_size=8``); an unknown knob is an error
that lists the decoder's knobs.

Requests
- ``generate_until``: greedy unless a ``temperature`` knob says otherwise (task
  sampling settings are ignored: the decoders define decoding); ``gen_length``
  is the knob when given, else the request's ``max_gen_toks``; the text is cut
  at the first stop string. Rows are batched (left padding) when
  ``batch_size`` > 1 and the decoder's registry entry says ``batched`` (docs/decoders.md); else they are
  decoded one at a time. The default is 1, as in the paper.
- ``loglikelihood``: exact for causal checkpoints (one forward, sum of token
  log-probs). For bidirectional (``config.is_causal = False``) checkpoints it is
  the Monte-Carlo estimate LLaDA uses: mask a random subset of the continuation
  (the mask count is stratified over [1, L] across the ``mc_num`` draws), score
  the masked tokens with the logits at their own positions, weight by L / count,
  average; ``is_greedy`` comes from filling the masked continuation one most
  confident position at a time and comparing with the target.
- ``loglikelihood_rolling``: causal checkpoints only.

Speed counting follows docs/design.md §6: the decoder call is timed alone, after a
warm-up call, with device synchronisation; generated tokens, NFE and KV bytes come
from the decoder's stats. With ``journal_dir`` every finished request is appended
to a fsynced journal, and a request already there is answered from it instead of
being recomputed (resume after ``kill -9``). A request that meets an item fault (out of memory,
non-finite logits, a forward budget run past: harness/run/faults.py) is retried in halves of its
batch down to one row; one that fails alone is journaled as failed (an empty answer, scored as wrong)
and kept on resume unless ``retry_failed=True``.

The class keeps lm-eval's interface and hands the work to three named pieces, one module each:
request (``lm_requests.RequestPlan``: knobs, journal key, batches) -> decoder call
(``lm_decode.DecoderCall``: tokens in, timed call, records out) -> journal record
(``lm_records.Records``: what is answered, journaled, counted); log-likelihoods are scored by
``lm_likelihood``.

Data parallel: under ``accelerate launch`` with several processes each rank gets
its share of the documents from lm-eval; ``all_gather``/``gather_object``/
``barrier`` below are what lm-eval's evaluator calls to merge them.
"""

from __future__ import annotations

import json
import os
import random
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from harness.models.checkpoints import CheckpointError, CheckpointInfo, inspect_checkpoint, load_model, resolve_dtype
from harness.run.lm_decode import DecoderCall
from harness.run.lm_likelihood import Scorer
from harness.run.lm_records import PAUSE_ENV, Records
from harness.run.lm_requests import RequestPlan, loglikelihood_key
from harness.run.store import request_key

__all__ = ["MODEL_NAME", "PAUSE_ENV", "CheckpointError", "RefusionBenchLM", "checkpoint_knobs", "describe",
           "parse_chat_template_args", "set_seed"]

MODEL_NAME = "refusion_bench"
LM_EVAL_EXTRAS = ("parallelize", "trust_remote_code", "max_length")  # lm-eval's own CLI may add these; not knobs


def checkpoint_knobs(info: CheckpointInfo, decoder: str) -> dict[str, Any]:
    """Decoder knobs a checkpoint sets for itself (below the task's settings and the model's knobs):
    - a family whose logits are shifted (Dream, harness/models/families.py) sets ``shift=true`` for the decoders that
      have the knob (fast_dllm, d2f), so Dream + Fast-dLLM / D2F read the logit at i-1 for token i;
    - the decoding settings its own files hold, for the decoders registered with ``folder_knobs``
      (refusion.decoding.checkpoint_defaults: Dream's generation_config.json; DiffusionGemma's config.json
      canvas_length and generation_config.json), read from the base folder of an adapter.
    Reads JSON only, so it runs before the model is loaded; a bad value raises ValueError naming the file."""
    from refusion.decoding import checkpoint_defaults, get_decoder

    out: dict[str, Any] = {}
    if info.family.logit_shift and "shift" in get_decoder(decoder).knobs.names():
        out["shift"] = True
    out.update(checkpoint_defaults(decoder, info.base.path if info.base is not None else info.path))
    return out


def parse_chat_template_args(value: str | dict | None) -> dict[str, Any]:
    """``enable_thinking=false;x=1`` (or a dict) -> keyword arguments of ``apply_chat_template``."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    from lm_eval.utils import handle_arg_string

    out: dict[str, Any] = {}
    for part in str(value).replace(";", ",").split(","):
        k, eq, v = part.strip().partition("=")
        if not part.strip():
            continue
        if not eq or not k.strip():
            raise ValueError(f"chat template argument {part.strip()!r}: expected name=value")
        out[k.strip()] = handle_arg_string(v.strip())
    return out


def checked_knobs(info: CheckpointInfo, decoder: str, knobs: dict[str, Any],
                  task_knobs: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The checkpoint's own knobs, after checking, before any weight is read, that the decoder can run
    on this checkpoint's attention and that the knobs of the model and of every task are valid."""
    from refusion.decoding import check_attention, make_knobs

    check_attention(decoder, info.causal, info.family.name)
    own = checkpoint_knobs(info, decoder)
    make_knobs(decoder, {**own, **knobs})  # bad knobs fail here, before the model is loaded
    for tk in (task_knobs or {}).values():
        make_knobs(decoder, {**own, **tk, **knobs})
    return own


def device_and_ranks(device: str | None) -> tuple[torch.device, Any, tuple[int, int] | None]:
    """(device, accelerator, (rank, world size)) of this process: under ``accelerate launch`` with several
    processes accelerate's device and ranks (gloo on CPUs), else (device, None, None); lm-eval's CLI
    defaults to "cuda", so on a machine without one the CPU is the only choice."""
    accelerator, ranks = None, None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import Accelerator

        acc = Accelerator(cpu=device in (None, "cpu") and not torch.cuda.is_available())
        if acc.num_processes > 1:
            accelerator, ranks, device = acc, (acc.process_index, acc.num_processes), str(acc.device)
    if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device), accelerator, ranks


# ---------------------------------------------------------------- the lm-eval model


def _no_scoring(family: str, decoder: str) -> str | None:
    """Why a checkpoint answers no log-likelihood request (None: it does): a decoder with a model class of its
    own (DiffusionGemma) has no LM forward to score with."""
    from refusion.decoding import DECODERS

    if DECODERS[decoder].family is None:
        return None
    return (f"{family} checkpoints answer generate requests only (decoder {decoder!r}); this task asks for "
            "log-likelihoods")


@register_model(MODEL_NAME)
class RefusionBenchLM(TemplateLM):
    """lm-eval's model interface over one checkpoint and one decoder (module docstring)."""

    backend = "causal"  # for TemplateLM._encode_pair: encode context + continuation together, then split

    def __init__(self, pretrained: str, decoder: str = "ar", batch_size: int | str | None = 1,
                 device: str | None = None, dtype: str = "auto", seed: int = 1234, threads: int | None = None,
                 journal_dir: str | None = None, task_knobs: dict[str, dict[str, Any]] | None = None,
                 mc_num: int = 64, mc_batch: int = 16, warmup: bool = True, trust_remote_code: bool = False,
                 response_extract: str | None = None, base: str | None = None,
                 chat_template_args: str | dict | None = None,
                 max_batch_size: int | None = None,  # lm-eval passes it; batches are fixed-size here
                 retry_failed: bool = False, **knobs: Any) -> None:
        super().__init__()
        from refusion.decoding import get_decoder

        self.decoder = get_decoder(decoder)  # unknown name: ValueError listing the valid ones
        knobs = {k: v for k, v in knobs.items() if k not in LM_EVAL_EXTRAS}
        info = inspect_checkpoint(pretrained, base)  # the whole folder, before any weight is read
        self.checkpoint_knobs = checked_knobs(info, decoder, knobs, task_knobs)
        if response_extract not in (None, "python_fence"):
            raise ValueError(f"response_extract must be python_fence or unset, got {response_extract!r}")
        self.decoder_name, self.response_extract, self.seed = decoder, response_extract, int(seed)
        self.plan = RequestPlan(decoder, set(self.decoder.knobs.names()), self.checkpoint_knobs, task_knobs,
                                knobs, self.seed)
        self.knobs, self.task_knobs, self.knobs_for = self.plan.knobs, self.plan.task_knobs, self.plan.knobs_for
        self.mc_num, self.mc_batch = int(mc_num), int(mc_batch)
        self.batch_size = 1 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if threads:
            torch.set_num_threads(int(threads))
        self._device, self.accelerator, ranks = device_and_ranks(device)
        if ranks is not None:
            self._rank, self._world_size = ranks
        self.pretrained = str(pretrained)
        if trust_remote_code:
            raise ValueError("trust_remote_code: this harness runs no checkpoint's own code; released folders "
                             "load onto transformers' classes by their family (harness/models/families.py)")
        self.chat_template_args = parse_chat_template_args(chat_template_args)
        self.dtype = resolve_dtype(dtype, str(self._device))
        loaded = load_model(pretrained, device=str(self._device), dtype=self.dtype, base=base, info=info)
        self.model, self.tokenizer, self.family = loaded.model, loaded.tokenizer, loaded.family
        self.causal = info.causal
        self.call = DecoderCall(self.decoder, decoder, self.model, self.tokenizer, self._device,
                                response_extract=response_extract, warmup=warmup)
        self.eos, self.mask = self.call.eos, self.call.mask
        self.scorer = Scorer(self.model, self._device, causal=self.causal, mask=self.mask,
                             pretrained=self.pretrained, seed=self.seed, mc_num=self.mc_num, mc_batch=self.mc_batch,
                             refuse=_no_scoring(self.family.name, decoder))
        self.records = Records(journal_dir, self.rank, retry_failed=bool(retry_failed))
        self.journal, self._done, self.keys_by_task = self.records.journal, self.records.done, self.records.keys_by_task

    computed = property(lambda self: self.records.computed, doc="requests run in this process")
    served = property(lambda self: self.records.served, doc="requests answered from the journal")
    warmup_s = property(lambda self: self.call.warmup_s, doc="seconds of the warm-up call, None before it")
    warmup_compile = property(lambda self: self.call.warmup_compile,
                              doc="graphs the warm-up call compiled and their seconds (decoder knob compile)")
    rank = property(lambda self: self._rank)
    world_size = property(lambda self: self._world_size)
    tokenizer_name = property(lambda self: str(self.tokenizer.name_or_path).replace("/", "__"))
    eot_token_id = property(lambda self: self.eos[0])
    prefix_token_id = property(lambda self: self.eot_token_id if self.tokenizer.bos_token_id is None
                               else self.tokenizer.bos_token_id)

    # ------------------------------------------------ lm-eval plumbing: data parallel, chat template, tokens

    def all_gather(self, tensor):
        return tensor if self.accelerator is None else self.accelerator.gather(tensor)

    def gather_object(self, obj, dst=0):
        if self.accelerator is None:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return chat_template if isinstance(chat_template, str) else getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"checkpoint {self.pretrained!r} has no chat template; run without one")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.chat_template_args)

    def get_model_info(self) -> dict:
        return {"pretrained": self.pretrained, "decoder": self.decoder_name, "knobs": self.knobs,
                "checkpoint_knobs": self.checkpoint_knobs, "response_extract": self.response_extract,
                "task_knobs": self.task_knobs, "causal": self.causal, "dtype": self.dtype,
                "family": self.family.name, "chat_template_args": self.chat_template_args}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Special tokens are already in the (chat-templated) text; never add a second BOS.
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    # ------------------------------------------------ generate_until: request -> decoder call -> journal record

    def decode_record(self, context: str, task: str | None = None, gen_kwargs: dict | None = None) -> dict:
        """One prompt decoded outside lm-eval, exactly as a run decodes and records it (``harness trace``):
        the journal record, with the decode trace. ``context`` is the text as lm-eval would send it (chat
        template already applied); ``task`` picks the task's decoding defaults."""
        req = SimpleNamespace(args=(context, dict(gen_kwargs or {})), task_name=task, doc_id=0, idx=0)
        return self.call.run([self.plan.prepare(req)], self.rank)[0]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        bar = partial(tqdm, total=len(requests), disable=disable_tqdm or self.rank != 0,
                      desc=f"{self.decoder_name} generate", dynamic_ncols=True)
        items = [self.plan.prepare(req) for req in requests]
        return self.records.answer(items, partial(self.call.run, rank=self.rank),
                                   self.batch_size if self.decoder.batched else 1, lambda initial: bar(initial=initial))

    # ------------------------------------------------ loglikelihood (lm_likelihood.Scorer)

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's pair encoding (TemplateLM._encode_pair); an empty context is the prefix token."""
        if not context:
            return [self.prefix_token_id], self.tok_encode(continuation)
        return self._encode_pair(context, continuation)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's token-level entry: ((context, continuation), ctx ids, cont ids) per request."""
        return [self.scorer.score(ctx, cont, request_key("loglikelihood_tokens", context, continuation, self.causal,
                                                          self.mc_num, self.seed))
                for (context, continuation), ctx, cont in requests]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="loglikelihood", dynamic_ncols=True):
            key = loglikelihood_key(req, self.causal, self.mc_num, self.seed)
            rec = self.records.lookup(req.task_name, key)
            if rec is None:
                ll, greedy = self.scorer.score(*self._split(*req.args), key)
                rec = {"key": key, "kind": "loglikelihood", "task": req.task_name, "doc_id": req.doc_id,
                       "idx": req.idx, "rank": self.rank, "loglikelihood": ll, "is_greedy": greedy}
                self.records.record(rec)
            out.append((rec["loglikelihood"], rec["is_greedy"]))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        if not self.causal:
            raise NotImplementedError("loglikelihood_rolling needs a causal checkpoint; "
                                      f"{self.pretrained!r} is bidirectional (config.is_causal=False)")
        return [self.scorer.rolling(self.tok_encode(req.args[0]), self.prefix_token_id)
                for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="loglikelihood_rolling")]


def attach_engine(lm: RefusionBenchLM, engine: dict | None, log: str) -> RefusionBenchLM:
    """An engine row (run.json's model ``engine``, decoder ar@vllm): start its server and let ``lm``'s decoder
    calls go to it (harness/run/engine_decoder.py) instead of the ar loop; ``lm`` unchanged without one."""
    if engine:
        from pathlib import Path

        from harness.run.engine import EngineSpec
        from harness.run.engine_decoder import EngineDecoder

        lm.engine = EngineDecoder(lm.decoder, EngineSpec(**engine["knobs"]), lm.pretrained, lm.dtype,
                                  str(lm._device), Path(log))
        lm.call.decoder = lm.engine
    return lm


def close_engine(lm: RefusionBenchLM) -> None:
    """Stop an engine row's server (nothing otherwise); also done at exit and on a stop signal."""
    if getattr(lm, "engine", None) is not None:
        lm.engine.close()


def set_seed(seed: int) -> None:
    """Seed every RNG a decode might touch (decoders also take their own seed knob)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def describe(lm: RefusionBenchLM) -> str:
    return json.dumps(lm.get_model_info(), sort_keys=True)
