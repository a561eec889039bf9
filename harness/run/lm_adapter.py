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
  ``batch_size`` > 1 (every decoder takes batches: ``ar``, ``refusion``,
  ``llada``, ``fast_dllm``, ``dream``, ``d2f``); the default is 1, as in the paper.
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
being recomputed (resume after ``kill -9``).

Data parallel: under ``accelerate launch`` with several processes each rank gets
its share of the documents from lm-eval; ``all_gather``/``gather_object``/
``barrier`` below are what lm-eval's evaluator calls to merge them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import postprocess_generated_text
from lm_eval.api.registry import register_model
from tqdm import tqdm

from harness.models.checkpoints import CheckpointError, CheckpointInfo, inspect_checkpoint, load_model, resolve_dtype
from harness.run.store import Journal, request_key

MODEL_NAME = "refusion_bench"
PAUSE_ENV = "REFUSION_BENCH_PAUSE_AFTER"  # test hook: see RefusionBenchLM._maybe_pause


def checkpoint_knobs(info: CheckpointInfo, decoder: str) -> dict[str, Any]:
    """Decoder knobs a checkpoint sets for itself (below the task's settings and the model's knobs):
    - a family whose logits are shifted (Dream, harness/models/families.py) sets ``shift=true`` for the decoders that
      have the knob (fast_dllm, d2f), so Dream + Fast-dLLM / D2F read the logit at i-1 for token i;
    - for ``dream``, the DreamGenerationConfig fields of its generation_config.json
      (refusion.decoding.mdm.dream_generation_defaults).
    Reads JSON only, so it runs before the model is loaded; a bad value raises ValueError naming the file."""
    from refusion.decoding import get_decoder

    out: dict[str, Any] = {}
    if info.family.logit_shift and "shift" in get_decoder(decoder).knobs.names():
        out["shift"] = True
    if decoder == "dream":
        from refusion.decoding.mdm import dream_generation_defaults

        folder = info.base.path if info.base is not None else info.path
        out.update(dream_generation_defaults(folder))
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


# ---------------------------------------------------------------- the lm-eval model


@register_model(MODEL_NAME)
class RefusionBenchLM(TemplateLM):
    def __init__(
        self,
        pretrained: str,
        decoder: str = "ar",
        batch_size: int | str | None = 1,
        device: str | None = None,
        dtype: str = "auto",
        seed: int = 1234,
        threads: int | None = None,
        journal_dir: str | None = None,
        task_knobs: dict[str, dict[str, Any]] | None = None,
        mc_num: int = 64,
        mc_batch: int = 16,
        warmup: bool = True,
        trust_remote_code: bool = False,
        response_extract: str | None = None,
        base: str | None = None,
        chat_template_args: str | dict | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it; batches are fixed-size here
        **knobs: Any,
    ) -> None:
        super().__init__()
        from refusion.decoding import check_attention as get_decoder_check_attention
        from refusion.decoding import get_decoder, make_knobs

        self.decoder = get_decoder(decoder)  # unknown name: ValueError listing the valid ones
        for k in list(knobs):
            # lm-eval's own CLI may add these; they are not knobs
            if k in ("parallelize", "trust_remote_code", "max_length"):
                knobs.pop(k)
        # The checkpoint's own decoding defaults (checkpoint_knobs): below task defaults and model_args.
        info = inspect_checkpoint(pretrained, base)  # the whole folder, before any weight is read
        get_decoder_check_attention(decoder, info.causal)
        self.checkpoint_knobs = checkpoint_knobs(info, decoder)
        make_knobs(decoder, {**self.checkpoint_knobs, **knobs})  # bad knobs fail here, before the model is loaded
        for tk in (task_knobs or {}).values():
            make_knobs(decoder, {**self.checkpoint_knobs, **tk, **knobs})
        if response_extract not in (None, "python_fence"):
            raise ValueError(f"response_extract must be python_fence or unset, got {response_extract!r}")
        self.response_extract = response_extract
        self.decoder_name = decoder
        self.knobs = dict(knobs)  # as given (they key the journal); the decoder fills in defaults
        self.task_knobs = {t: dict(v) for t, v in (task_knobs or {}).items()}
        self.knob_names = set(self.decoder.knobs.names())
        self._knob_objs: dict[str, Any] = {}  # validated knob sets by their JSON, built once each
        self.seed = int(seed)
        self.mc_num, self.mc_batch = int(mc_num), int(mc_batch)
        self.batch_size = 1 if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if threads:
            torch.set_num_threads(int(threads))

        self.accelerator = None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import Accelerator

            want_cpu = device in (None, "cpu") and not torch.cuda.is_available()
            acc = Accelerator(cpu=want_cpu)
            if acc.num_processes > 1:
                self.accelerator = acc
                self._rank, self._world_size = acc.process_index, acc.num_processes
                device = str(acc.device)
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            # lm-eval's CLI defaults to "cuda"; on a machine without one the CPU is the only choice.
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        self.pretrained = str(pretrained)
        if trust_remote_code:
            raise ValueError("trust_remote_code: this harness runs no checkpoint's own code; released folders "
                             "load onto transformers' classes by their family (harness/models/families.py)")
        self.chat_template_args = parse_chat_template_args(chat_template_args)
        self.dtype = resolve_dtype(dtype, str(self._device))
        loaded = load_model(pretrained, device=str(self._device), dtype=self.dtype, base=base, info=info)
        self.model, self.tokenizer, self.family = loaded.model, loaded.tokenizer, loaded.family
        self.causal = info.causal
        self._special_ids()

        self.journal = Journal(journal_dir, self.rank) if journal_dir else None
        self._done: dict[str, dict] = self.journal.load() if self.journal else {}
        self.keys_by_task: dict[str, list[str]] = {}
        self.computed = 0  # requests actually run in this process (not served from the journal)
        self.served = 0  # requests answered from the journal
        self._warm = not warmup
        self.warmup_s: float | None = None

    # ------------------------------------------------ lm-eval plumbing

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

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

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if isinstance(chat_template, str):
            return chat_template
        return getattr(self.tokenizer, "chat_template", None)

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

    # ------------------------------------------------ helpers

    backend = "causal"  # for TemplateLM._encode_pair: encode context + continuation together, then split

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Special tokens are already in the (chat-templated) text; never add a second BOS.
        return list(self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])


    @property
    def eot_token_id(self) -> int:
        return self.eos[0]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def _special_ids(self) -> None:
        """EOS and mask ids by the decoders' rules (refusion/decoding/common.py: the model's generation
        config, else its config), plus the tokenizer's EOS; passed to every decoder call, so the
        decoders cut responses and the adapter counts tokens by the same set."""
        from refusion.decoding.common import eos_ids, mask_id

        ids = list(eos_ids(self.model, None))
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(int(self.tokenizer.eos_token_id))
        self.eos: tuple[int, ...] = tuple(ids)
        try:
            self.mask: int | None = mask_id(self.model, None)
        except ValueError:  # a causal checkpoint without a mask id; bidirectional ones need it
            tok_mask = getattr(self.tokenizer, "mask_token_id", None)
            self.mask = int(tok_mask) if tok_mask is not None else None

    def knobs_for(self, task: str | None, gen_kwargs: dict) -> dict[str, Any]:
        """Effective knobs of one request: the checkpoint's defaults < task defaults < model_args; gen_length
        falls back to max_gen_toks."""
        k = {**self.checkpoint_knobs, **self.task_knobs.get(task or "", {}), **self.knobs}
        if "gen_length" in self.knob_names and "gen_length" not in k:
            k["gen_length"] = int(gen_kwargs.get("max_gen_toks", 256))
        if "seed" in self.knob_names and "seed" not in k:
            k["seed"] = self.seed
        return k

    def _knob_obj(self, knobs: dict[str, Any]):
        """The decoder's knob dataclass for one knob dict (validated once, then reused)."""
        from refusion.decoding import make_knobs

        key = json.dumps(knobs, sort_keys=True)
        if key not in self._knob_objs:
            self._knob_objs[key] = make_knobs(self.decoder_name, knobs)
        return self._knob_objs[key]

    def _record(self, rec: dict) -> None:
        self._done[rec["key"]] = rec
        if self.journal is not None:
            self.journal.append(rec)
            self._maybe_pause()

    def _maybe_pause(self) -> None:
        # Test hook (environment only, never a knob): freeze after N journaled samples so a
        # kill-and-resume test interrupts the run at a chosen point instead of racing a timer.
        stop_after = os.environ.get(PAUSE_ENV)
        if stop_after and sum(1 for _ in open(self.journal.path, encoding="utf-8")) >= int(stop_after):
            print(f"{PAUSE_ENV}={stop_after}: paused after {stop_after} journaled samples", file=sys.stderr,
                  flush=True)
            while True:
                signal.pause()

    def _track(self, task: str | None, key: str) -> None:
        self.keys_by_task.setdefault(task or "", []).append(key)

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    # ------------------------------------------------ generate_until

    def _prepare(self, req) -> dict:
        context, gen_kwargs = req.args
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        knobs = self.knobs_for(req.task_name, gen_kwargs)
        key = request_key("generate_until", req.task_name, req.doc_id, context,
                          {k: v for k, v in gen_kwargs.items()}, self.decoder_name, knobs)
        return {"key": key, "context": context, "until": until, "knobs": knobs, "task": req.task_name,
                "doc_id": req.doc_id, "idx": req.idx}

    def _cut(self, tokens: list[int], until: list[str]) -> str:
        """Response text: the decoder's tokens (already cut after the first EOS) without the EOS, then
        lm-eval's stop-sequence rule."""
        if tokens and tokens[-1] in self.eos:
            tokens = tokens[:-1]
        text = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True), until, None)
        if self.response_extract == "python_fence":  # --prompts paper: the authors' wrapper does this
            from tasks.scoring import python_fence

            text = python_fence(text)
        return text

    def _run_batch(self, items: list[dict]) -> list[dict]:
        prompts = [self.tok_encode(it["context"]) for it in items]
        if len(prompts) == 1:
            ids, mask = torch.tensor(prompts, dtype=torch.long), None
        else:  # left padding by the tokenizer (its pad id; the mask tells the decoders what is real)
            padded = self.tokenizer.pad({"input_ids": prompts}, padding=True, padding_side="left",
                                        return_tensors="pt")
            ids, mask = padded["input_ids"], padded["attention_mask"]
        ids = ids.to(self._device)
        mask = mask.to(self._device) if mask is not None else None
        attn = mask
        special = {"eos_token_id": list(self.eos), "mask_token_id": self.mask}
        knobs = self._knob_obj(items[0]["knobs"])
        if not self._warm:
            # Warm-up: the first real call pays for allocator growth and lazy init; excluded from timing.
            t0 = time.perf_counter()
            # Same knobs as the real call: a shortened gen_length can violate block/slot constraints.
            self.decoder(self.model, ids[:1, -len(prompts[0]):], None, knobs, **special)
            self._sync()
            self.warmup_s = time.perf_counter() - t0
            self._warm = True
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        self._sync()
        t0 = time.perf_counter()
        tokens, stats = self.decoder(self.model, ids, attn, knobs, **special)
        self._sync()
        wall = time.perf_counter() - t0
        gpu_peak = torch.cuda.max_memory_allocated(self._device) if self._device.type == "cuda" else None
        out = []
        for row, (it, p, toks) in enumerate(zip(items, prompts, tokens)):
            toks = [int(t) for t in toks.tolist()]  # cut by the decoder after the first EOS (docs/design.md §6)
            rec = {
                "key": it["key"], "kind": "generate", "task": it["task"], "doc_id": it["doc_id"],
                "idx": it["idx"], "rank": self.rank, "prompt_tokens": len(p), "tokens": toks,
                "generated_tokens": len(toks),
                "nfe": int(stats["nfe"]),
                # In a batch every row shares the batch's forwards and wall time; split time evenly
                # so that sums over samples stay equal to the real decode time.
                "decode_s": wall / len(items), "batch_wall_s": wall, "batch_size": len(items),
                "forward_s": stats["timings"]["forward_s"] / len(items),
                "kv_peak_bytes": stats.get("kv_peak_bytes"), "gpu_peak_bytes": gpu_peak,
                "knobs": it["knobs"], "response": self._cut(toks, it["until"]),
            }
            rec["tpf"] = rec["generated_tokens"] / rec["nfe"] if rec["nfe"] else 0.0
            rec.update({k: int(v) for k, v in stats.items() if k.startswith("nfe_")})
            if "commit_forward" in stats:  # the decode trace (harness trace): per token, the forward that fixed it
                rec.update(commit_forward=stats["commit_forward"][row], commit_kind=stats["commit_kind"][row],
                           forward_phase=stats["forward_phase"])
            out.append(rec)
        return out

    def decode_record(self, context: str, task: str | None = None, gen_kwargs: dict | None = None) -> dict:
        """One prompt decoded outside lm-eval, exactly as a run decodes and records it (``harness trace``):
        the journal record, with the decode trace. ``context`` is the text as lm-eval would send it (chat
        template already applied); ``task`` picks the task's decoding defaults."""
        req = SimpleNamespace(args=(context, dict(gen_kwargs or {})), task_name=task, doc_id=0, idx=0)
        return self._run_batch([self._prepare(req)])[0]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        todo: list[tuple[int, dict]] = []
        for i, req in enumerate(requests):
            it = self._prepare(req)
            self._track(it["task"], it["key"])
            if it["key"] in self._done:
                results[i] = self._done[it["key"]]["response"]
                self.served += 1
            else:
                todo.append((i, it))
        bs = self.batch_size if self.decoder.batched else 1
        batches: list[list[tuple[int, dict]]] = []
        for i, it in todo:
            last = batches[-1] if batches else None
            if last and len(last) < bs and last[0][1]["knobs"] == it["knobs"]:
                last.append((i, it))
            else:
                batches.append([(i, it)])
        bar = tqdm(total=len(requests), initial=len(requests) - len(todo), disable=disable_tqdm or self.rank != 0,
                   desc=f"{self.decoder_name} generate", dynamic_ncols=True)
        toks_sum, secs_sum = 0, 0.0
        for batch in batches:
            fresh = [it for _, it in batch if it["key"] not in self._done]  # DP padding repeats a request
            recs = {r["key"]: r for r in self._run_batch(fresh)} if fresh else {}
            for i, it in batch:
                rec = recs.get(it["key"]) or self._done[it["key"]]
                if it["key"] in recs:
                    self._record(rec)
                    self.computed += 1
                    toks_sum += rec["generated_tokens"]
                    secs_sum += rec["decode_s"]
                results[i] = rec["response"]
            bar.update(len(batch))
            if secs_sum > 0:
                bar.set_postfix(tok_s=f"{toks_sum / secs_sum:.1f}")
        bar.close()
        return [r if r is not None else "" for r in results]

    # ------------------------------------------------ loglikelihood

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's pair encoding (TemplateLM._encode_pair); an empty context is the prefix token."""
        if not context:
            return [self.prefix_token_id], self.tok_encode(continuation)
        return self._encode_pair(context, continuation)

    @torch.no_grad()
    def _ll_causal(self, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        ids = torch.tensor([ctx + cont], dtype=torch.long, device=self._device)
        logits = self.model(input_ids=ids[:, :-1]).logits.float()[0, len(ctx) - 1:]
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(cont, device=self._device)
        ll = float(logp.gather(-1, target[:, None]).sum())
        greedy = bool((logp.argmax(-1) == target).all())
        return ll, greedy

    def _mask_id(self) -> int:
        if self.mask is None:
            raise ValueError(f"checkpoint {self.pretrained!r} is bidirectional but names no mask_token_id")
        return self.mask

    @torch.no_grad()
    def _ll_mdm(self, ctx: list[int], cont: list[int], key: str) -> tuple[float, bool]:
        mask_id, n_ctx, L = self._mask_id(), len(ctx), len(cont)
        seq = torch.tensor(ctx + cont, dtype=torch.long, device=self._device)
        gen = torch.Generator().manual_seed(int(key[:8], 16) ^ self.seed)
        draws = max(self.mc_num, 1)
        total, done = 0.0, 0
        while done < draws:
            b = min(self.mc_batch, draws - done)
            # Stratified mask counts: evenly spaced over [1, L] from a random start, so a
            # small batch still covers light and heavy masking (lower variance than iid counts).
            start = int(torch.randint(1, L + 1, (1,), generator=gen))
            counts = [((start - 1 + round(j * L / b)) % L) + 1 for j in range(b)]
            batch = seq.repeat(b, 1)
            masked = torch.zeros(b, n_ctx + L, dtype=torch.bool)
            for r, c in enumerate(counts):
                pos = torch.randperm(L, generator=gen)[:c] + n_ctx
                masked[r, pos] = True
            masked = masked.to(self._device)
            batch[masked] = mask_id
            logp = torch.log_softmax(self.model(input_ids=batch).logits.float(), -1)
            tok_ll = logp.gather(-1, seq.repeat(b, 1)[..., None])[..., 0]
            w = torch.tensor([L / c for c in counts], device=self._device)
            total += float(((tok_ll * masked).sum(-1) * w).sum())
            done += b
        ll = total / draws
        # Greedy check: unmask the most confident position one at a time.
        x = seq.clone()
        x[n_ctx:] = mask_id
        target = seq[n_ctx:]
        for _ in range(L):
            probs = torch.softmax(self.model(input_ids=x[None]).logits.float()[0, n_ctx:], -1)
            conf, pred = probs.max(-1)
            still = x[n_ctx:] == mask_id
            conf = torch.where(still, conf, torch.full_like(conf, -1.0))
            j = int(conf.argmax())
            x[n_ctx + j] = pred[j]
        return ll, bool((x[n_ctx:] == target).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's token-level entry: ((context, continuation), ctx ids, cont ids) per request."""
        out = []
        for (context, continuation), ctx, cont in requests:
            key = request_key("loglikelihood_tokens", context, continuation, self.causal, self.mc_num, self.seed)
            out.append(self._score(ctx, cont, key))
        return out

    def _score(self, ctx: list[int], cont: list[int], key: str) -> tuple[float, bool]:
        if not cont:
            return 0.0, True
        return self._ll_causal(ctx, cont) if self.causal else self._ll_mdm(ctx, cont, key)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="loglikelihood", dynamic_ncols=True):
            context, continuation = req.args
            key = request_key("loglikelihood", req.task_name, req.doc_id, context, continuation,
                              self.causal, self.mc_num, self.seed)
            self._track(req.task_name, key)
            if key in self._done:
                rec = self._done[key]
                self.served += 1
            else:
                ll, greedy = self._score(*self._split(context, continuation), key)
                rec = {"key": key, "kind": "loglikelihood", "task": req.task_name, "doc_id": req.doc_id,
                       "idx": req.idx, "rank": self.rank, "loglikelihood": ll, "is_greedy": greedy}
                self._record(rec)
                self.computed += 1
            out.append((rec["loglikelihood"], rec["is_greedy"]))
        return out

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        if not self.causal:
            raise NotImplementedError("loglikelihood_rolling needs a causal checkpoint; "
                                      f"{self.pretrained!r} is bidirectional (config.is_causal=False)")
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        max_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        prefix = self.prefix_token_id
        out = []
        for req in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc="loglikelihood_rolling"):
            (text,) = req.args
            total = 0.0
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), prefix, max_len, 1)):
                total += self._ll_causal(list(ctx), list(cont))[0]
            out.append(total)
        return out


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
