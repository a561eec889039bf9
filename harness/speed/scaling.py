"""`make scaling` / `python -m harness scaling`: cost as the work grows.

    python -m harness scaling [--decoders ar,refusion,llada,fast_dllm] [--quick] [--memory-budget 1GiB]
                              [--out results/scaling.json] [--report reports/scaling]

For each decoder preset (harness/run/presets.py: checkpoint, decoder, knobs) three sweeps, each with the
other two sizes fixed: **generation length**, **prompt length** and **batch size**. At every point:

- latency and tokens/s by the timing protocol (harness/run/timing.py): per point, one side per decoder, an
  untimed warm-up, then ``--rounds`` interleaved ABBA rounds; the figures are medians over rounds;
- NFE, TPF, generated tokens and the decoder's own KV peak, from its stats;
- peak decode memory with its breakdown (kv_cache, logits, other) from the dispatch tracker
  (harness/run/memory.py), weights apart; deterministic on the CPU.

**Fixed work.** Every decode is passed ``eos_token_id=-1`` (``NO_EOS``): no token has that id, so no row ever
ends early and every decoder generates exactly ``gen_length`` tokens per row, whatever the tiny model would
emit; ``stop_at_eos`` is set false where a decoder has it (it cannot fire either). LLaDA runs its preset
schedule (``steps`` = gen_length: one token per step, NFE = gen_length); Fast-dLLM's threshold keeps its NFE
data-dependent, as in the paper, and the NFE it took is recorded. Prompts are the embedded suite's questions as
chat prompts, lengthened by worked examples as earlier turns and cut to the length from the left
(``chat_prompt_ids``): text the tiny models were trained on, so ReFusion's and Fast-dLLM's parallelism is what it
is on real prompts (on random token ids they are unsure and commit about one token per forward). The same ids
for every decoder; all rows of a batch have one length, so the attention mask is all ones (None is passed).

**Fits.** Per decoder and sweep, the log-log slope (least squares of log y on log x) of latency, peak memory
and tokens/s; for memory against batch also the linear fit peak = a + b * batch and its R^2.

**Budget** (``--memory-budget``): per decoder, the largest batch B* with a + b * B* + weights <= budget, from
the linear fit of the batch sweep (its prompt and generation length). Its throughput is measured by a timed
decode (warm-up + ``--budget-rounds``) at min(B*, ``--budget-max-batch``), with a tracked decode at that batch
to check the fit's prediction. B* itself is extrapolated wherever it is above the largest measured batch. When
B* is above the cap, the throughput at B* is extrapolated too, and marked so: latency taken linear in batch,
fitted on the ``EXTRAPOLATION_POINTS`` largest measured batches (``latency_line``), tokens/s = B* x gen /
(a + b B*).

**Engine rows.** ``ar@vllm`` (``<preset>@<engine>`` for an AR preset, docs/engines.md) is that checkpoint served by
vLLM's server (harness/run/engine.py, from ``--engine-venv``), started once and stopped at the end whatever
happens. It takes part in every sweep's timed rounds as one more side: B prompts sent at once, latency at the
client, the server waited on until it is quiet before and after each of its blocks (outside the clocks), and
``ignore_eos`` so it too generates exactly ``gen_length`` tokens per row. Its memory lives in the server's
process, where the tracker cannot see it: its points carry no peak, and it has no budget row. The default
decoders include it where the engine's venv exists (`make setup-vllm`).

**Resume.** Each finished point (all decoders at one size) is written at once to a partial file beside
``--out`` named by a hash of the settings; a run with the same settings continues from it, and it is removed
when the final JSON is written. Docs: docs/reports.md "Scaling".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from harness.run.store import atomic_write_json, dumps

REPO = Path(__file__).resolve().parents[2]
NO_EOS = -1  # eos_token_id passed to every decode: no token has it, so every row generates gen_length tokens
SWEEPS = ("gen", "prompt", "batch")
DEFAULT_DECODERS = ("ar", "refusion", "llada", "fast_dllm")
ENGINE_ROW = "ar@vllm"  # added to the default decoders where --engine-venv exists
DEFAULT_ENGINE_VENV = ".venv-vllm"
ENGINE_MEMORY = ("not tracked: the engine decodes in its own server process, outside this process's tracker "
                 "(its KV cache is preallocated: the engine knob kv_cache_memory_bytes)")
# The default run (about 10 minutes on an idle 2-core CPU, one torch thread) and --quick (a few seconds).
DEFAULTS = {"gen_lengths": (32, 64, 128, 256, 512), "gen_prompt": 32,
            "prompt_lengths": (32, 128, 256, 512, 768), "prompt_gen": 32,
            "batches": (1, 2, 4, 8, 16, 32), "batch_prompt": 32, "batch_gen": 32,
            "rounds": 3, "budget_max_batch": 64, "budget_rounds": 1}
# --quick (tests): 8 and 16 tokens, so the MDM presets' block_length 32 becomes 8 (QUICK_KNOBS, recorded in each
# point's knobs); the budget's cap is the sweep's largest batch, whose point is reused (no extra decode).
QUICK = {"gen_lengths": (8, 16), "gen_prompt": 8, "prompt_lengths": (8, 16), "prompt_gen": 8,
         "batches": (1, 2, 4), "batch_prompt": 8, "batch_gen": 8, "rounds": 1, "budget_max_batch": 4,
         "budget_rounds": 1}
QUICK_KNOBS = {"block_length": 8}  # set for every decoder that has the knob
DEFAULT_BUDGET = "1GiB"
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
PROMPT_KINDS = ("math", "code", "choice")
SHOTS_PER_ROW = 16  # row r's worked examples start at train item 16 r (mod the split's size)
PROMPT_RECIPE = ("row r of length n (chat_prompt_ids): embedded kind ('math', 'code', 'choice')[r % 3], its test "
                 "item r // 3 as the user turn after worked examples (train items 16 r, 16 r + 1, ... as user / "
                 "assistant turns) added until the chat-templated prompt (with the generation prompt) holds n "
                 "tokens; its last n tokens")
WORK_FIXED = ("eos_token_id=-1 on every decode (no token has id -1: every row generates exactly gen_length "
              "tokens); stop_at_eos=false where the decoder has it; LLaDA at its preset schedule (one token a "
              "step, NFE = gen_length); Fast-dLLM's NFE stays data-dependent (its threshold) and is recorded")


class InputError(ValueError):
    """A bad option value: one `error:` line, exit 2."""


# ---------------------------------------------------------------- parsing


def parse_bytes(text: str | int) -> int:
    """A memory size: bytes (``1073741824``) or a number with a unit, binary (KiB, MiB, GiB, TiB) or decimal (KB,
    MB, GB, TB), case-insensitive, spaces allowed (``1GiB``, ``512 MiB``, ``1.5gb``). InputError otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS or float(m.group(1)) * UNITS[unit] < 1:
        raise InputError(f"--memory-budget: cannot read {str(text)!r} as a memory size > 0; give bytes or a number "
                         "with KiB, MiB, GiB, TiB (binary) or KB, MB, GB, TB (decimal), e.g. 1GiB or 512MiB")
    return int(float(m.group(1)) * UNITS[unit])


def parse_sizes(text: str, option: str) -> tuple[int, ...]:
    """A comma list of positive integers, ascending and distinct (InputError naming the option otherwise)."""
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        values = ()
    if len(values) < 2 or min(values) < 1 or list(values) != sorted(set(values)):
        raise InputError(f"{option}: give at least two distinct positive integers in ascending order, comma "
                         f"separated (e.g. 32,64,128), got {text!r}")
    return values


def parse_decoders(text: str) -> tuple[str, ...]:
    """Preset names (harness/run/presets.py), or ``<preset>@<engine>`` for an AR preset served by an engine,
    comma separated; InputError listing the valid ones."""
    from harness.run.engine import ENGINE_SEP, ENGINES
    from harness.run.presets import PRESETS

    names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    for n in names or ("",):
        preset, sep, engine = n.partition(ENGINE_SEP)
        if preset not in PRESETS:
            raise InputError(f"unknown decoder {n!r}; valid decoders: {', '.join(PRESETS)}, or an AR one served by "
                             f"an engine: {', '.join(f'ar{ENGINE_SEP}{e}' for e in ENGINES)}")
        if sep and (engine not in ENGINES or PRESETS[preset].decoder != "ar"):
            raise InputError(f"decoder {n!r}: an engine serves an AR preset only, and the engines are "
                             f"{', '.join(ENGINES)} (e.g. ar{ENGINE_SEP}{ENGINES[0]})")
    return names


def spec_of(name: str):
    """The ModelSpec of a decoder of the run: a preset (harness/run/presets.py), or ``<preset>@<engine>``, the
    preset with its engine set."""
    from dataclasses import replace

    from harness.run.engine import ENGINE_SEP
    from harness.run.presets import PRESETS

    preset, sep, engine = name.partition(ENGINE_SEP)
    return replace(PRESETS[preset], name=name, engine=engine) if sep else PRESETS[preset]


def default_decoders(engine_venv: str) -> tuple[str, ...]:
    """DEFAULT_DECODERS, and the engine row where the engine's venv has a python (not checked further here:
    the run checks that vllm imports before any model loads)."""
    from harness.run.engine import EngineSpec

    return DEFAULT_DECODERS + ((ENGINE_ROW,) if EngineSpec(venv=engine_venv).python().is_file() else ())


# ---------------------------------------------------------------- fits


def loglog_fit(xs, ys) -> dict | None:
    """Least squares of log y on log x: {slope, intercept (natural log), r2, n}; None with fewer than two
    points or a value <= 0. A slope of 1 is linear growth, 2 quadratic, 0 flat."""
    import numpy as np

    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pts) < 2 or any(x <= 0 or y <= 0 for x, y in pts) or len({x for x, _ in pts}) < 2:
        return None
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return {**_least_squares(lx, ly), "n": len(pts)}


def linear_fit(xs, ys) -> dict | None:
    """Least squares of y on x: {slope, intercept, r2, n}; None with fewer than two distinct x."""
    import numpy as np

    pts = [(float(x), float(y)) for x, y in zip(xs, ys) if x is not None and y is not None]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    return {**_least_squares(np.array([p[0] for p in pts]), np.array([p[1] for p in pts])), "n": len(pts)}


def _least_squares(x, y) -> dict:
    dx, dy = x - x.mean(), y - y.mean()
    slope = float((dx * dy).sum() / (dx * dx).sum())
    intercept = float(y.mean() - slope * x.mean())
    ss_tot = float((dy * dy).sum())
    ss_res = float(((y - (intercept + slope * x)) ** 2).sum())
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0}


def budget_batch(fit: dict | None, weights: int, budget: int) -> int | None:
    """The largest batch B >= 1 with intercept + slope * B + weights <= budget (the linear fit of peak decode
    bytes on batch); 0 when not even batch 1 fits, None without a fit or with a slope <= 0."""
    if not fit or fit["slope"] <= 0:
        return None
    return max(0, math.floor((budget - weights - fit["intercept"]) / fit["slope"]))


# ---------------------------------------------------------------- prompts and decodes


def chat_prompt_ids(tokenizer, length: int, row: int) -> list[int]:
    """Row ``row`` of the prompts of ``length`` tokens (PROMPT_RECIPE): an embedded-suite question as the last
    user turn, worked examples of its kind before it until the chat prompt holds ``length`` tokens, cut from
    the left so it ends with the generation prompt."""
    from tasks.embedded import load_split

    kind = PROMPT_KINDS[row % len(PROMPT_KINDS)]
    test, train = load_split(kind, "test"), load_split(kind, "train")
    question = {"role": "user", "content": test[(row // len(PROMPT_KINDS)) % len(test)]["query"]}
    shots: list[dict] = []
    while True:
        text = tokenizer.apply_chat_template(shots + [question], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= length:
            return [int(t) for t in ids[len(ids) - length:]]
        shot = train[(SHOTS_PER_ROW * row + len(shots) // 2) % len(train)]
        shots += [{"role": "user", "content": shot["query"]}, {"role": "assistant", "content": shot["response"]}]


def clear_decoder_memos() -> None:
    """Empty the lru caches of refusion's modules (common.id_tensor, the slot patterns): tensors a decoder
    helper memoizes are counted by the call that makes them (harness/run/memory.py), so every tracked decode
    starts from empty memos and its peak is the same whatever the process decoded before."""
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] != "refusion":
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
                value.cache_clear()


def decode_tracked(decoder: str, model, ids, knobs, special: dict) -> tuple[list, dict, dict]:
    """One decode of registered ``decoder`` under the peak-memory tracker, memos cleared first:
    (tokens, stats, memory result)."""
    from harness.run.memory import measure_decode

    clear_decoder_memos()
    return measure_decode(decoder, model, ids, None, knobs, special=special)


def knob_values(preset: str, gen: int, overrides: dict | None = None) -> dict:
    """The full knob dict of a preset at generation length ``gen``: the checkpoint folder's own knobs, the
    preset's, ``overrides`` of the knobs the decoder has, gen_length, and stop_at_eos false where the decoder
    has it (validated: ValueError naming the knob)."""
    from refusion.decoding import checkpoint_defaults, get_decoder, make_knobs

    spec = spec_of(preset)
    names = get_decoder(spec.decoder).knobs.names()
    values = {**checkpoint_defaults(spec.decoder, REPO / spec.checkpoint), **spec.knobs,
              **{k: v for k, v in (overrides or {}).items() if k in names}, "gen_length": gen}
    if "stop_at_eos" in names:
        values["stop_at_eos"] = False
    return make_knobs(spec.decoder, values).to_dict()


# ---------------------------------------------------------------- the plan


def settings_of(a: argparse.Namespace) -> dict:
    """What a run's numbers depend on (the partial file is keyed by its hash)."""
    base = QUICK if a.quick else DEFAULTS
    pick = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in base.items()}
    engines = {}
    for d in a.decoders:
        if spec_of(d).engine:
            from harness.run.engine import EngineSpec

            # the server batches at least the sweep's largest batch together
            engines[d] = EngineSpec(engine=spec_of(d).engine, venv=a.engine_venv,
                                    max_num_seqs=max(EngineSpec.max_num_seqs, *pick["batches"])).to_dict()
    return {"decoders": list(a.decoders), "presets": {d: spec_of(d).to_dict() for d in a.decoders},
            **({"engines": engines} if engines else {}),
            "sweeps": {"gen": {"values": list(pick["gen_lengths"]), "prompt": pick["gen_prompt"], "batch": 1},
                       "prompt": {"values": list(pick["prompt_lengths"]), "gen": pick["prompt_gen"], "batch": 1},
                       "batch": {"values": list(pick["batches"]), "prompt": pick["batch_prompt"],
                                 "gen": pick["batch_gen"]}},
            "rounds": pick["rounds"], "order": "abba", "threads": a.threads,
            "memory_budget_bytes": a.memory_budget, "budget_max_batch": pick["budget_max_batch"],
            "budget_rounds": pick["budget_rounds"], "eos_token_id": NO_EOS, "quick": bool(a.quick),
            "knob_overrides": dict(QUICK_KNOBS) if a.quick else {}}


def plan(settings: dict) -> list[dict]:
    """Every point of the sweeps: {sweep, x, batch, prompt, gen}, in run order."""
    out = []
    for sweep in SWEEPS:
        s = settings["sweeps"][sweep]
        for x in s["values"]:
            size = {"batch": s.get("batch"), "prompt": s.get("prompt"), "gen": s.get("gen"), sweep: x}
            out.append({"sweep": sweep, "x": x, **size})
    return out


def point_key(sweep: str, x: int, decoder: str) -> str:
    return f"{sweep}/{x}/{decoder}"


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def partial_path(out: Path, settings: dict) -> Path:
    return out.with_name(f".{out.stem}.{settings_hash(settings)}.partial.json")


# ---------------------------------------------------------------- measuring


class Scaling:
    """One run: the loaded models, the prompt table and the partial state, written after every point."""

    def __init__(self, settings: dict, partial: Path, progress: bool = True):
        self.settings, self.partial, self.progress = settings, partial, progress
        self.models: dict[str, Any] = {}
        self.engines: dict[str, Any] = {}  # name -> EngineDecoder (a started server), made on first use
        self.engine_versions: dict[str, dict] = {}
        self.state = {"settings": settings, "prompts": {}, "points": {}, "budget": {}}
        if partial.is_file():
            old = json.loads(partial.read_text(encoding="utf-8"))
            if old.get("settings") == settings:
                self.state = old
        self.resumed = bool(self.state["points"])
        self.bar = None

    def lm(self, preset: str):
        """The loaded checkpoint of a decoder (an engine row's too: its tokenizer, config and weights' size)."""
        from harness.models.checkpoints import load_model

        path = spec_of(preset).checkpoint
        if path not in self.models:
            self.models[path] = load_model(str(REPO / path))
        return self.models[path]

    def engine(self, name: str):
        """The engine row's server, started on first use (EngineDecoder: the ar decoder's call, served)."""
        if name not in self.engines:
            from harness.run.engine import EngineSpec
            from harness.run.engine_decoder import EngineDecoder
            from refusion.decoding import get_decoder

            spec = EngineSpec(**self.settings["engines"][name])
            log = REPO / "results" / "tmp" / f"scaling-{settings_hash(self.settings)}-{name.replace('@', '-')}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            self.engines[name] = EngineDecoder(get_decoder("ar"), spec, str(REPO / spec_of(name).checkpoint),
                                               "float32", "cpu", log)
        return self.engines[name]

    def close(self) -> None:
        """Stop every engine server this run started (also done at exit and on SIGTERM by the server's keeper)."""
        for engine in self.engines.values():
            engine.close()

    def check(self) -> None:
        """Every knob set and size is valid before anything decodes, and an engine row's venv imports vllm
        before any model loads (InputError naming what is wrong)."""
        from harness.run.engine import EngineError, EngineSpec, check_engine

        for d, spec in self.settings.get("engines", {}).items():
            try:
                self.engine_versions[d] = check_engine(EngineSpec(**spec))
            except EngineError as e:
                raise InputError(f"{d}: {e}") from None
        gens = sorted({p["gen"] for p in plan(self.settings)})
        first = self.lm(self.settings["decoders"][0]).tokenizer
        for d in self.settings["decoders"]:
            tok = self.lm(d).tokenizer
            if tok.get_vocab() != first.get_vocab() or tok.chat_template != first.chat_template:
                raise InputError(f"{d}: its tokenizer or chat template differs from {self.settings['decoders'][0]}'s, "
                                 "so the decoders cannot share prompt ids; run them in separate runs")
            ctx = getattr(self.lm(d).model.config, "max_position_embeddings", None)
            for p in plan(self.settings):
                if ctx is not None and p["prompt"] + p["gen"] > ctx:
                    raise InputError(f"{d}: prompt {p['prompt']} + generation {p['gen']} tokens exceed the "
                                     f"model's context of {ctx} positions ({p['sweep']} sweep)")
            for g in gens:
                try:
                    knob_values(d, g, self.settings["knob_overrides"])
                except ValueError as e:
                    raise InputError(f"{d} at gen_length {g}: {e}") from None

    def prompts(self, length: int, batch: int, preset: str) -> list[str]:
        """The keys of a batch's rows in the prompt table (filled on first use)."""
        keys = [f"{length}/{r}" for r in range(batch)]
        missing = [k for k in keys if k not in self.state["prompts"]]
        if missing:
            tokenizer = self.lm(self.settings["decoders"][0]).tokenizer  # one tokenizer for all (check)
            for k in missing:
                self.state["prompts"][k] = chat_prompt_ids(tokenizer, length, int(k.split("/")[1]))
        return keys

    def save(self) -> None:
        atomic_write_json(self.partial, self.state)

    def record(self, preset: str, size: dict) -> tuple[dict, Any, dict]:
        """A point's reproduction record, its input ids and its knob dict (before any decode)."""
        import torch

        spec, lm = spec_of(preset), self.lm(preset)
        keys = self.prompts(size["prompt"], size["batch"], preset)
        ids = torch.tensor([self.state["prompts"][k] for k in keys], dtype=torch.long)
        knobs = knob_values(preset, size["gen"], self.settings["knob_overrides"])
        special = {"eos_token_id": NO_EOS, "mask_token_id": lm.mask_id}
        rec = {"sweep": size["sweep"], "x": size["x"], "decoder": preset, "decoder_fn": spec.decoder,
               "checkpoint": spec.checkpoint, "batch": size["batch"], "prompt_length": size["prompt"],
               "gen_length": size["gen"], "knobs": knobs, "special_ids": special, "prompts": keys,
               "attention_mask": "all ones (None passed)"}
        if spec.engine:
            rec["engine"] = {"name": spec.engine, "spec": self.settings["engines"][preset],
                             "stop": "ignore_eos (no stop id, not the model's own EOS either)"}
        return rec, ids, knobs

    def engine_call(self, rec: dict, ids, knobs: dict):
        """A zero-argument decode of an engine row's point: (per-row token counts, generated tokens, nfe)."""
        from refusion.decoding import make_knobs

        engine, obj = self.engine(rec["decoder"]), make_knobs("ar", knobs)

        def fn():
            toks, st = engine(None, ids, None, obj, eos_token_id=None, ignore_eos=True)
            counts = [len(t) for t in toks]  # the tokens themselves are the server's (not compared here)
            return counts, sum(counts), st["nfe"]
        return fn

    def memory(self, rec: dict, ids, knobs: dict) -> dict:
        """The tracked decode of one point: counts and peak memory into ``rec``; its tokens are returned. An
        engine row decodes once untracked (ENGINE_MEMORY) and returns its per-row token counts instead."""
        if rec.get("engine"):
            counts, generated, nfe = self.engine_call(rec, ids, knobs)()
            rec.update(nfe=nfe, tpf=generated / nfe, generated_tokens=generated, kv_peak_bytes=None, nfe_phases={},
                       memory={"peak_bytes": None, "breakdown": None,
                               "weights_bytes": None, "method": ENGINE_MEMORY})
            self._fixed_work(rec)
            return {"tokens": counts, "nfe": nfe}
        tokens, stats, mem = decode_tracked(rec["decoder_fn"], self.lm(rec["decoder"]).model, ids, knobs,
                                            rec["special_ids"])
        rec.update(nfe=stats["nfe"], tpf=stats["tpf"], generated_tokens=stats["generated_tokens"],
                   kv_peak_bytes=stats["kv_peak_bytes"],
                   nfe_phases={k: v for k, v in stats.items() if k.startswith("nfe_")},
                   memory={k: mem[k] for k in ("peak_bytes", "breakdown", "weights_bytes", "method")})
        self._fixed_work(rec)
        return {"tokens": [t.tolist() for t in tokens], "nfe": stats["nfe"]}

    @staticmethod
    def _fixed_work(rec: dict) -> None:
        if rec["generated_tokens"] != rec["batch"] * rec["gen_length"]:
            raise RuntimeError(f"{rec['decoder']} generated {rec['generated_tokens']} tokens at {rec['sweep']}="
                               f"{rec['x']}, not batch x gen_length = {rec['batch'] * rec['gen_length']}: the work "
                               "is not fixed")

    def timed(self, label: str, entries: list[tuple[dict, Any, dict, dict]], rounds: int) -> None:
        """Interleaved timed rounds (harness/run/timing.py) of one group: one side per decoder, each decoding
        its own point; figures into each record, checked against the tracked decode's tokens and NFE."""
        from harness.run import timing
        from harness.run.guard import Guard
        from refusion.decoding import get_decoder

        def call(rec, ids, knobs):
            if rec.get("engine"):
                return self.engine_call(rec, ids, knobs)
            dec, model = get_decoder(rec["decoder_fn"]), self.lm(rec["decoder"]).model

            def fn():
                toks, st = dec(model, ids, None, knobs, **rec["special_ids"])
                return [t.tolist() for t in toks], st["generated_tokens"], st["nfe"]
            return fn

        sides = [timing.FnSide(rec["decoder"], {label: [call(rec, ids, knobs)]},
                               settle=self.engine(rec["decoder"]).wait_quiet if rec.get("engine") else None)
                 for rec, ids, knobs, _ in entries]
        got = timing.run_rounds(sides, [label], rounds=rounds, guard=Guard(), progress=False, desc=label)
        guard = got["guard"] or {}
        for side, (rec, _, _, first) in zip(sides, entries):
            if side.outputs[(label, 0)] != first["tokens"] or side.extra[(label, 0)][0] != first["nfe"]:
                raise RuntimeError(f"{rec['decoder']} at {label}: the timed decode gave other tokens or NFE than the "
                                   "tracked one (the decode is not deterministic)")
            fig = timing.figure(got["records"], side.name, label, key=label)
            rec["timing"] = {"latency_s": fig["latency_s"], "latency_interval": fig["latency_interval"],
                             "tokens_per_s": fig["tokens_per_s"], "tokens_per_s_interval": fig["interval"],
                             "cpu_tokens_per_s": fig["cpu_tokens_per_s"], "per_round_tokens_per_s": fig["per_round"],
                             "rounds": fig["rounds"], "repeat": got["repeat"][label][side.name],
                             "order": got["order"], "busy": bool(guard.get("busy")),
                             "others_share": guard.get("others_share")}
            if rec.get("engine"):
                # the decode's CPU is the server's, not this process's; its quiet waits were outside the clocks
                rec["timing"].update(cpu_tokens_per_s=None, latency_at="client", quiet_wait_s=sum(side.settle_s))

    def run_group(self, size: dict, pending: list[str], rounds: int) -> list[dict]:
        """Tracked decode of every pending decoder at one size, then their timed rounds; the records."""
        entries = []
        for d in pending:
            rec, ids, knobs = self.record(d, size)
            first = self.memory(rec, ids, knobs)
            entries.append((rec, ids, knobs, first))
        self.timed(f"{size['sweep']}={size['x']}", entries, rounds)
        return [e[0] for e in entries]

    def sweeps(self) -> None:
        """Every point of the plan not in the partial file yet, group by group, each written when done."""
        for size in plan(self.settings):
            pending = [d for d in self.settings["decoders"]
                       if point_key(size["sweep"], size["x"], d) not in self.state["points"]]
            if not pending:
                continue
            if self.bar is not None:
                self.bar.set_postfix_str(f"{size['sweep']}={size['x']}")
            for rec in self.run_group(size, pending, self.settings["rounds"]):
                self.state["points"][point_key(rec["sweep"], rec["x"], rec["decoder"])] = rec
            self.save()
            if self.bar is not None:
                self.bar.update(len(pending))

    def budget(self, fits: dict) -> None:
        """Per decoder the largest batch under the budget (linear fit), then one group timing each decoder at
        min(that batch, the cap), with a tracked decode there to check the fit. A batch the batch sweep
        measured already (same prompt and generation length) reuses that point."""
        s, pending = self.settings, []
        batch_sweep = s["sweeps"]["batch"]
        for d in s["decoders"]:
            if d in self.state["budget"]:
                continue
            if spec_of(d).engine:
                self.state["budget"][d] = {"weights_bytes": None, "fit": None, "largest_batch": None,
                                           "measured_batch": None, "not_in_budget": ENGINE_MEMORY}
                continue
            weights = self.state["points"][point_key("batch", batch_sweep["values"][0], d)]["memory"]["weights_bytes"]
            fit = fits[d]["batch"]["memory_linear"]
            best = budget_batch(fit, weights, s["memory_budget_bytes"])
            entry = {"weights_bytes": weights, "fit": fit, "largest_batch": best, "measured_batch": None}
            if best:
                entry["measured_batch"] = bm = min(best, s["budget_max_batch"])
                if bm in batch_sweep["values"]:
                    entry.update(point=self.state["points"][point_key("batch", bm, d)], reused="batch sweep point")
                else:
                    pending.append((d, entry))
                    continue
            self.state["budget"][d] = entry
        if pending:
            if self.bar is not None:
                self.bar.set_postfix_str("budget")
            entries = []
            for d, entry in pending:
                size = {"sweep": "budget", "x": entry["measured_batch"], "batch": entry["measured_batch"],
                        "prompt": batch_sweep["prompt"], "gen": batch_sweep["gen"]}
                rec, ids, knobs = self.record(d, size)
                entries.append((rec, ids, knobs, self.memory(rec, ids, knobs)))
            self.timed("budget", entries, s["budget_rounds"])
            for (d, entry), (rec, *_rest) in zip(pending, entries):
                self.state["budget"][d] = {**entry, "point": rec}
        self.save()
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)


# ---------------------------------------------------------------- results


def fits_of(settings: dict, points: dict) -> dict:
    """Per decoder and sweep: log-log fits of latency, peak memory, tokens/s and NFE on the swept size, and
    for the batch sweep the linear fit of peak memory on batch."""
    out: dict = {}
    for d in settings["decoders"]:
        out[d] = {}
        for sweep in SWEEPS:
            xs = settings["sweeps"][sweep]["values"]
            recs = [points.get(point_key(sweep, x, d)) for x in xs]
            if any(r is None for r in recs):
                continue
            lat = [r["timing"]["latency_s"] for r in recs]
            mem = [r["memory"]["peak_bytes"] for r in recs]
            out[d][sweep] = {"latency_s": loglog_fit(xs, lat), "peak_bytes": loglog_fit(xs, mem),
                             "tokens_per_s": loglog_fit(xs, [r["timing"]["tokens_per_s"] for r in recs]),
                             "nfe": loglog_fit(xs, [r["nfe"] for r in recs])}
            if sweep == "batch":
                out[d][sweep]["memory_linear"] = linear_fit(xs, mem)
    return out


EXTRAPOLATION_POINTS = 3  # the largest measured batches the latency line is fitted on


def latency_line(settings: dict, state: dict, decoder: str, extra: dict | None) -> dict | None:
    """The linear fit of latency on batch over the ``EXTRAPOLATION_POINTS`` largest measured batches of one
    decoder (the batch sweep's, and the budget point ``extra`` when it is another batch), with their batches."""
    by_batch = {x: state["points"][point_key("batch", x, decoder)] for x in settings["sweeps"]["batch"]["values"]}
    if extra is not None:
        by_batch[extra["batch"]] = extra
    xs = sorted(by_batch)[-EXTRAPOLATION_POINTS:]
    fit = linear_fit(xs, [by_batch[x]["timing"]["latency_s"] for x in xs])
    return None if fit is None else {**fit, "batches": xs}


def budget_table(settings: dict, state: dict) -> dict:
    """The budget rows: largest batch, the measured batch's throughput and peak against the fit's prediction.
    Above the cap the throughput at the largest batch B* is extrapolated and says so: latency taken linear in
    batch (``latency_line``: once the rows fill the machine each row adds the same seconds), tokens/s =
    B* x gen / (a + b B*); with a line that does not rise the measured figure stands, marked as such."""
    rows = {}
    for d in settings["decoders"]:
        b = state["budget"].get(d)
        if b is None:
            continue
        row = {k: b[k] for k in ("weights_bytes", "fit", "largest_batch", "measured_batch")}
        if b.get("not_in_budget"):
            rows[d] = {**row, "throughput": f"no budget row: memory {b['not_in_budget']}"}
            continue
        measured = settings["sweeps"]["batch"]["values"]
        if row["largest_batch"] is not None and row["largest_batch"] > max(measured):
            row["largest_batch_extrapolated"] = (f"extrapolated: the linear fit of batches "
                                                 f"{', '.join(map(str, measured))} carried to {row['largest_batch']}")
        rec = b.get("point")
        if rec is not None:
            fit, bm = b["fit"], rec["batch"]
            tps = rec["timing"]["tokens_per_s"]
            row.update(measured_tokens_per_s=tps, measured_latency_s=rec["timing"]["latency_s"],
                       measured_peak_bytes=rec["memory"]["peak_bytes"],
                       predicted_peak_bytes=fit["intercept"] + fit["slope"] * bm, nfe=rec["nfe"], tpf=rec["tpf"],
                       busy=rec["timing"]["busy"], tokens_per_s_at_largest=tps,
                       throughput="measured" + (f" (the {b['reused']})" if b.get("reused") else ""))
            row["prediction_error"] = row["measured_peak_bytes"] / row["predicted_peak_bytes"] - 1
            if b["largest_batch"] > bm:
                line = latency_line(settings, state, d, rec)
                row["latency_line"] = line
                big = b["largest_batch"]
                if line and line["slope"] > 0:
                    row["tokens_per_s_at_largest"] = big * rec["gen_length"] / (line["intercept"] + line["slope"] * big)
                    row["throughput"] = (f"extrapolated from batch {bm} (the cap) to {big}: latency linear in batch, "
                                         f"{line['intercept']:.3g} s + {line['slope']:.3g} s/row, fitted on batches "
                                         f"{', '.join(map(str, line['batches']))} (R² {line['r2']:.3f})")
                else:
                    row["tokens_per_s_at_largest"] = None
                    row["throughput"] = (f"measured at batch {bm} (the cap) only: latency did not rise with batch over "
                                         "the largest measured batches, so nothing is extrapolated to the budget's")
        rows[d] = row
    return rows


def result_of(settings: dict, state: dict, argv: list[str], env: dict, elapsed: float, resumed: bool) -> dict:
    points = state["points"]
    fits = fits_of(settings, points)
    ordered = [points[point_key(p["sweep"], p["x"], d)] for p in plan(settings) for d in settings["decoders"]]
    engines = {"engines": {d: {"spec": spec, "versions": state.get("engine_versions", {}).get(d)}
                           for d, spec in settings["engines"].items()}} if settings.get("engines") else {}
    busy = any(r["timing"]["busy"] for r in ordered) or any(
        (b.get("point") or {}).get("timing", {}).get("busy") for b in state["budget"].values())
    return {"command": " ".join(["python -m harness scaling", *argv]),
            "environment": env,
            "settings": settings, "how_work_is_fixed": WORK_FIXED, "prompt_recipe": PROMPT_RECIPE,
            "timing": {"protocol": "harness/run/timing.py: per point an untimed warm-up, then interleaved ABBA "
                                   "rounds, one side per decoder; figures are medians over rounds",
                       "rounds": settings["rounds"], "budget_rounds": settings["budget_rounds"],
                       "busy_machine": busy},
            "points": ordered, "fits": fits,
            "budget": {"budget_bytes": settings["memory_budget_bytes"], "max_batch": settings["budget_max_batch"],
                       "rule": "largest batch B with intercept + slope * B + weights <= budget, from the linear fit "
                               "of peak decode bytes on batch over the batch sweep (its prompt and generation "
                               "length); throughput measured at min(B, max_batch)",
                       "decoders": budget_table(settings, state)},
            "prompts": state["prompts"], "elapsed_s": elapsed, "resumed": resumed, **engines}


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def print_summary(result: dict) -> None:
    """The slopes and the budget, as plain lines on stdout."""
    print("log-log slopes (latency | peak memory) and memory R^2 (linear in batch):")
    for d, f in result["fits"].items():
        parts = []
        for sweep in SWEEPS:
            s = f.get(sweep, {})
            lat, mem = s.get("latency_s"), s.get("peak_bytes")
            parts.append(f"{sweep} {lat['slope']:.2f} | {mem['slope']:.2f}" if lat and mem else
                         f"{sweep} {lat['slope']:.2f} | -" if lat else f"{sweep} -")
        lin = f.get("batch", {}).get("memory_linear")
        print(f"  {d:<12} " + "   ".join(parts) + (f"   R^2 {lin['r2']:.4f}" if lin else ""))
    b = result["budget"]
    print(f"budget {b['budget_bytes'] / 2**30:.3g} GiB (peak decode memory + weights):")
    for d, r in b["decoders"].items():
        if r.get("largest_batch") is None and r.get("throughput", "").startswith("no budget row"):
            print(f"  {d:<12} {r['throughput']}")
            continue
        tps = r.get("tokens_per_s_at_largest")
        how = "measured" if r.get("throughput", "").startswith("measured") else "extrapolated"
        print(f"  {d:<12} largest batch {r['largest_batch']}"
              + (" (extrapolated)" if r.get("largest_batch_extrapolated") else "")
              + f"  measured at {r['measured_batch']}"
              + (f" ({r['measured_tokens_per_s']:.1f} tok/s)" if r.get("measured_tokens_per_s") else "")
              + (f"  at the largest batch {tps:.1f} tok/s ({how})" if tps else ""))


# ---------------------------------------------------------------- command


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness scaling", description=__doc__.split("\n\n")[0]
                                + " Latency, tokens/s, NFE, TPF and peak decode memory of each decoder against "
                                "generation length, prompt length and batch size, with log-log slopes and the "
                                "largest batch under a memory budget (docs/reports.md, Scaling).")
    p.add_argument("--decoders", default=None,
                   help="decoder presets (harness/run/presets.py), comma separated; an AR preset served by vLLM is "
                        f"{ENGINE_ROW} (default: {','.join(DEFAULT_DECODERS)}, and {ENGINE_ROW} where the engine "
                        "venv exists)")
    p.add_argument("--engine-venv", default=DEFAULT_ENGINE_VENV,
                   help="the engine rows' venv (`make setup-vllm`; default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and one round, a few seconds (tests); options given explicitly still apply")
    sizes = p.add_argument_group("sizes (defaults: the default run's, or --quick's)")
    sizes.add_argument("--gen-lengths", help=f"generation-length sweep (default {_csv(DEFAULTS['gen_lengths'])})")
    sizes.add_argument("--gen-prompt", type=int, help=f"its prompt length (default {DEFAULTS['gen_prompt']})")
    sizes.add_argument("--prompt-lengths", help=f"prompt-length sweep (default {_csv(DEFAULTS['prompt_lengths'])})")
    sizes.add_argument("--prompt-gen", type=int, help=f"its generation length (default {DEFAULTS['prompt_gen']})")
    sizes.add_argument("--batches", help=f"batch-size sweep (default {_csv(DEFAULTS['batches'])})")
    sizes.add_argument("--batch-prompt", type=int, help=f"its prompt length (default {DEFAULTS['batch_prompt']})")
    sizes.add_argument("--batch-gen", type=int, help=f"its generation length (default {DEFAULTS['batch_gen']})")
    p.add_argument("--rounds", type=int, help=f"timed ABBA rounds per point (default {DEFAULTS['rounds']})")
    p.add_argument("--memory-budget", default=DEFAULT_BUDGET,
                   help="memory budget for peak decode memory + weights: bytes or e.g. 1GiB, 512MiB, 2GB "
                        "(default %(default)s)")
    p.add_argument("--budget-max-batch", type=int,
                   help=f"largest batch the budget point is measured at (default {DEFAULTS['budget_max_batch']}); "
                        "above it the throughput at the budget's batch is extrapolated, and says so")
    p.add_argument("--budget-rounds", type=int,
                   help=f"timed rounds at the budget batch (default {DEFAULTS['budget_rounds']})")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default %(default)s: the tiny models run fastest on one, and a neighbour "
                        "on a shared 2-core machine does not make two threads spin)")
    p.add_argument("--out", default=str(REPO / "results" / "scaling.json"), help="result JSON (default %(default)s)")
    p.add_argument("--report", default=str(REPO / "reports" / "scaling"),
                   help="report folder: index.md and log-log figures (default %(default)s; '' = none)")
    p.add_argument("--restart", action="store_true", help="ignore a partial file of an earlier run with these settings")
    return p


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def _namespace(argv: list[str]) -> argparse.Namespace:
    """Parsed and checked options (InputError for a bad value)."""
    a = _parser().parse_args(argv)
    a.decoders_default = a.decoders is None
    a.decoders = parse_decoders(a.decoders if a.decoders is not None else ",".join(default_decoders(a.engine_venv)))
    a.memory_budget = parse_bytes(a.memory_budget)
    for name in ("gen_lengths", "prompt_lengths", "batches"):
        if getattr(a, name) is not None:
            setattr(a, name, parse_sizes(getattr(a, name), "--" + name.replace("_", "-")))
    for name in ("gen_prompt", "prompt_gen", "batch_prompt", "batch_gen", "rounds", "budget_max_batch",
                 "budget_rounds", "threads"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = _namespace(argv)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    from tqdm import tqdm

    from harness.run.engine import EngineError
    from harness.run.quiet import quiet_libraries

    quiet_libraries()  # no "Loading weights" bar per checkpoint: the run's own bar is the one to read
    torch.set_num_threads(a.threads)
    settings = settings_of(a)
    out = Path(a.out)
    partial = partial_path(out, settings)
    if a.restart:
        partial.unlink(missing_ok=True)
    t0 = time.perf_counter()
    from harness.run.environment import environment

    env = environment("cpu", a.threads, 1, 0)  # before anything is written: git_dirty is the code's
    run = Scaling(settings, partial)
    try:
        run.check()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run.state["engine_versions"] = run.engine_versions
    if a.decoders_default:
        print(f"decoders: {', '.join(settings['decoders'])}" + ("" if ENGINE_ROW in settings["decoders"] else
              f" (no engine row: {a.engine_venv} has no python; `make setup-vllm` adds {ENGINE_ROW})"),
              file=sys.stderr)
    total = len(plan(settings)) * len(settings["decoders"]) + len(settings["decoders"])
    done = len(run.state["points"]) + len(run.state["budget"])
    if run.resumed:
        print(f"resuming from {partial} ({done} of {total} points done)", file=sys.stderr)
    try:
        with tqdm(total=total, initial=done, desc="scaling", file=sys.stderr, unit="point") as run.bar:
            run.sweeps()
            run.budget(fits_of(settings, run.state["points"]))
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        run.close()
    result = result_of(settings, run.state, argv, env, time.perf_counter() - t0, run.resumed)
    atomic_write_json(out, result)
    if a.report:
        from harness.speed.scaling_report import write_report

        write_report(result, Path(a.report), out)
    partial.unlink(missing_ok=True)
    print_summary(result)
    print(f"wrote {out}" + (f" and {a.report}/index.md" if a.report else "") +
          f" in {result['elapsed_s']:.0f} s ({len(dumps(result)) / 2**20:.2f} MiB of JSON)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
