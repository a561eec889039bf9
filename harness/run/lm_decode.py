"""The decoder-call piece of the lm-eval model (``harness/run/lm_adapter.py``): prepared requests in,
journal records out. Tokenizes and left-pads a batch, calls the decoder (timed alone after one warm-up
call, with device synchronisation: docs/design.md §6), cuts the response text, and builds one record
per row from the decoder's stats. No decoding logic lives here. Under the decoder knob ``compile`` the
seconds of the call's warm-up forwards (compiling a new shape bucket; stats ``timings["compile_s"]``)
are recorded apart (``compile_s``, ``compilations``) and left out of ``decode_s``, as the decoder's
own timings leave them out (docs/design.md "Compiled decoding")."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import torch


def special_ids(model, tokenizer) -> tuple[tuple[int, ...], int | None]:
    """(EOS ids, mask id) by the decoders' rules (refusion/decoding/common.py: the model's generation
    config, else its config), plus the tokenizer's EOS; passed to every decoder call, so the decoders
    cut responses and the adapter counts tokens by the same set."""
    from refusion.decoding.common import eos_ids, mask_id

    ids = list(eos_ids(model, None))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    try:
        mask: int | None = mask_id(model, None)
    except ValueError:  # a causal checkpoint without a mask id; bidirectional ones need it
        tok_mask = getattr(tokenizer, "mask_token_id", None)
        mask = int(tok_mask) if tok_mask is not None else None
    return tuple(ids), mask


class DecoderCall:
    """One decoder on one loaded checkpoint: ``run(items, rank)`` decodes a batch of prepared requests
    (lm_requests.RequestPlan.prepare, equal knobs) and returns their journal records."""

    def __init__(self, decoder, decoder_name: str, model, tokenizer, device: torch.device, *,
                 response_extract: str | None, warmup: bool) -> None:
        self.decoder, self.decoder_name = decoder, decoder_name
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.response_extract = response_extract
        self.eos, self.mask = special_ids(model, tokenizer)
        self._knob_objs: dict[str, Any] = {}  # validated knob sets by their JSON, built once each
        self._warm = not warmup
        self.warmup_s: float | None = None
        self.warmup_compile = {"compilations": 0, "compile_s": 0.0}  # what the warm-up call compiled
        # The memory pass (harness/run/memory_pass.py): each call's peak decode memory under the tracker of
        # harness/run/memory.py, the warm-up call left out; ``last_memory`` holds the last call's.
        self.memory = False
        self.last_memory: dict | None = None

    def knob_obj(self, knobs: dict[str, Any]):
        """The decoder's knob dataclass for one knob dict (validated once, then reused)."""
        from refusion.decoding import make_knobs

        key = json.dumps(knobs, sort_keys=True)
        if key not in self._knob_objs:
            self._knob_objs[key] = make_knobs(self.decoder_name, knobs)
        return self._knob_objs[key]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def cut(self, tokens: list[int], until: list[str]) -> str:
        """Response text: the decoder's tokens (already cut after the first EOS) without the EOS, then
        lm-eval's stop-sequence rule."""
        from lm_eval.models.utils import postprocess_generated_text

        if tokens and tokens[-1] in self.eos:
            tokens = tokens[:-1]
        text = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True), until, None)
        if self.response_extract == "python_fence":  # --prompts paper: the authors' wrapper does this
            from tasks.scoring import python_fence

            text = python_fence(text)
        return text

    def _encode(self, items: list[dict]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor | None]:
        """Prompt ids per item and the batch: one row as is, several left padded by the tokenizer (its pad
        id; the mask tells the decoders what is real)."""
        prompts = [list(self.tokenizer(it["context"], add_special_tokens=False)["input_ids"]) for it in items]
        if len(prompts) == 1:
            ids, mask = torch.tensor(prompts, dtype=torch.long), None
        else:
            padded = self.tokenizer.pad({"input_ids": prompts}, padding=True, padding_side="left",
                                        return_tensors="pt")
            ids, mask = padded["input_ids"], padded["attention_mask"]
        return prompts, ids.to(self.device), mask.to(self.device) if mask is not None else None

    def _timed_call(self, ids, mask, prompt_len: int, knobs) -> tuple[Any, dict, float, float, int | None]:
        """(tokens, stats, wall seconds, CPU seconds of this process, GPU peak bytes) of the decoder call,
        warm-up excluded (harness/run/timing.py's clock)."""
        from harness.run.timing import clock

        special = {"eos_token_id": list(self.eos), "mask_token_id": self.mask}
        if not self._warm:
            # Warm-up: the first real call pays for allocator growth and lazy init; excluded from timing.
            t0 = time.perf_counter()
            # Same knobs as the real call: a shortened gen_length can violate block/slot constraints.
            _, warm = self.decoder(self.model, ids[:1, -prompt_len:], None, knobs, **special)
            self.sync()
            self.warmup_s = time.perf_counter() - t0
            self.warmup_compile = {"compilations": int(warm.get("compilations", 0)),
                                   "compile_s": float(warm["timings"].get("compile_s", 0.0))}
            self._warm = True
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        tracker = contextlib.nullcontext()
        if self.memory:
            from harness.run.memory import DecodeMemory

            # Compiled forwards are invisible to the dispatch tracker: on CUDA the allocator alone measures them.
            compiled = bool(getattr(knobs, "compile", False))
            tracker = DecodeMemory(self.model, dispatch=not (compiled and self.device.type == "cuda"))
        with tracker as mem:
            (tokens, stats), wall, cpu = clock(lambda: self.decoder(self.model, ids, mask, knobs, **special), self.sync)
        self.last_memory = mem.result() if self.memory else None
        gpu_peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return tokens, stats, wall, cpu, gpu_peak

    def run(self, items: list[dict], rank: int) -> list[dict]:
        """Decode one batch of prepared requests; their journal records, in order."""
        from harness.run.faults import injected_decode_faults

        prompts, ids, mask = self._encode(items)
        with injected_decode_faults(self.model, items, self.decoder_name):  # a test hook; nothing unless REFUSION_BENCH_FAULTS asks
            tokens, stats, wall, cpu, gpu_peak = self._timed_call(ids, mask, len(prompts[0]),
                                                             self.knob_obj(items[0]["knobs"]))
        out = []
        # Forwards that compiled a new shape bucket (compile knob): timed apart, not decoding time.
        compile_s = float(stats["timings"].get("compile_s", 0.0))
        wall = max(0.0, wall - compile_s)
        # An engine row (harness/run/engine_decoder.py): each request's seconds at the client, and the CPU the
        # server's processes spent on the call (this process only waits for the answers).
        row_latency = stats.get("row_latency_s") or [wall] * len(items)
        cpu += float(stats.get("engine_cpu_s", 0.0))
        for row, (it, p, toks) in enumerate(zip(items, prompts, tokens)):
            toks = [int(t) for t in toks.tolist()]  # cut by the decoder after the first EOS (docs/design.md §6)
            rec = {
                "key": it["key"], "kind": "generate", "task": it["task"], "doc_id": it["doc_id"],
                "idx": it["idx"], "rank": rank, "prompt_tokens": len(p), "tokens": toks,
                "generated_tokens": len(toks),
                "nfe": int(stats["nfe"]),
                # A request's latency is the whole call (the batch releases its rows together); decode_s is the
                # row's share of it, so sums over rows give the decode time (throughput: MLPerf's offline rule).
                "latency_s": row_latency[row], "decode_s": wall / len(items), "batch_wall_s": wall, "batch_size": len(items),
                "cpu_s": cpu / len(items),  # the process's CPU seconds in the call (all its threads)
                "forward_s": stats["timings"]["forward_s"] / len(items),
                "kv_peak_bytes": stats.get("kv_peak_bytes"), "gpu_peak_bytes": gpu_peak,
                "knobs": it["knobs"], "response": self.cut(toks, it["until"]),
                # split like decode_s (sums stay the batch's); the batch's compilations on its first row
                "compiled": bool(stats.get("compiled", False)), "compile_s": compile_s / len(items),
                "compilations": int(stats.get("compilations", 0)) if row == 0 else 0,
            }
            rec["tpf"] = rec["generated_tokens"] / rec["nfe"] if rec["nfe"] else 0.0
            # The call's id (its first row's key): the rows of one call share its time, so the statistics
            # resample them together (harness/run/stats.py batch_of).
            rec["batch_id"] = items[0]["key"]
            rec.update({k: int(v) for k, v in stats.items() if k.startswith("nfe_")})
            if "commit_forward" in stats:  # the decode trace (harness trace): per token, the forward that fixed it
                rec.update(commit_forward=stats["commit_forward"][row], commit_kind=stats["commit_kind"][row],
                           forward_phase=stats["forward_phase"])
            out.append(rec)
        return out
