"""Knob A/B: a decoder at its preset's knobs against the same decoder with one knob changed, same code, same
process, same items, interleaved; JSON to results/.

    python -m harness.speed.knob_ab --knob logits_chunk=none --out results/knob_ab_logits_chunk.json
    python -m harness.speed.knob_ab --knob logits_chunk=1 --presets refusion,d2f --rounds 10

What it measures: per preset (harness/run/presets.py) and embedded kind, the items of the speed A/B of `make
regress` (harness/speed/ab.py ``workload``: of the first ``--limit`` test items, as many as fill about 0.15 s,
at least one), decoded by two in-process sides -- "default" (the preset's knobs) and "changed" (the same with
``--knob``) -- by the timing protocol (harness/run/timing.py): an untimed warm-up, then ``--rounds`` interleaved
rounds (ABBA), one torch thread. Each row: both sides' tokens/s, the changed/default ratio of wall-time tokens/s
(the median over disjoint round pairs of the per-pair ratio) with its 95% bootstrap interval (round pairs and
items resampled), the same ratio in CPU time, and whether both sides generated the same number of tokens per
item. The two sides share one loaded model per checkpoint, so only the knob differs. A ratio measured here holds
for this machine and these (tiny) sizes only: a knob that trades work for memory can pay off at released size
and cost a few percent here.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time

import torch

from harness.run.store import atomic_write_json
from harness.speed import ab


class InProcess:
    """A decoding side in this process (ab.measure's worker interface): ``decode(item)`` with the item's knobs
    updated by ``override``; models loaded once per checkpoint and shared by every side built on ``models``."""

    def __init__(self, override: dict, models: dict) -> None:
        self.override, self.models = override, models

    def decode(self, it: ab.Item) -> dict:
        from harness.models.checkpoints import load_model
        from refusion.decoding import DECODERS

        if it.checkpoint not in self.models:
            self.models[it.checkpoint] = load_model(it.checkpoint)
        lm = self.models[it.checkpoint]
        c0, t0 = time.process_time(), time.perf_counter()
        _, stats = DECODERS[it.decoder](lm.model, torch.tensor([it.ids]), None, {**it.knobs, **self.override},
                                        eos_token_id=list(lm.eos_ids), mask_token_id=lm.mask_id)
        return {"seconds": time.process_time() - c0, "wall_seconds": time.perf_counter() - t0,
                "tokens": int(stats["generated_tokens"]), "nfe": int(stats["nfe"])}


def knob_value(text: str) -> tuple[str, object]:
    """``name=value`` -> (name, value): none, true / false, an integer, a number, else the string."""
    name, eq, raw = text.partition("=")
    if not eq or not name.strip():
        raise ValueError(f"--knob {text!r}: expected name=value")
    low = raw.strip().lower()
    if low in ("none", "null"):
        return name.strip(), None
    if low in ("true", "false"):
        return name.strip(), low == "true"
    for cast in (int, float):
        try:
            return name.strip(), cast(raw)
        except ValueError:
            pass
    return name.strip(), raw.strip()


def run(presets: tuple[str, ...], knob: str, value: object, limit: int, rounds: int, progress: bool = True) -> dict:
    """The A/B (module doc): {"knob", "value", "rows": [...], "machine", "rounds", "limit", "seconds", ...}."""
    from refusion.decoding import DECODERS

    items = ab.workload(presets, limit)
    lacking = sorted({it.decoder for it in items if knob not in DECODERS[it.decoder].knobs.names()})
    if lacking:
        raise ValueError(f"decoder(s) {', '.join(lacking)} have no knob {knob!r}")
    torch.set_num_threads(1)
    t0, models = time.time(), {}
    res = ab.measure(items, InProcess({knob: value}, models), InProcess({}, models), progress=progress,
                     rounds=rounds)
    rows = [{k: v for k, v in r.items() if k not in ("ok", "rule", "slowdown")} for r in ab.summarize(res)]
    mach = ab.machine()
    shown = "none" if value is None else str(value).lower() if isinstance(value, bool) else value
    return {"knob": knob, "value": value, "sides": {"current": f"{knob}={shown}", "baseline": "the preset's knobs"},
            "rows": rows, "records": res["records"], "rounds": rounds, "limit": limit, "threads": 1,
            "machine": {k: mach[k] for k in ("cpu", "key_flags", "cpu_count", "platform")},
            "torch": torch.__version__, "made": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.time() - t0, 1),
            "statistic": "changed / default wall-time tokens/s: median over round pairs of the per-pair ratio; "
                         "95% bootstrap interval over round pairs and items"}


def main(argv: list[str] | None = None) -> int:
    from harness.run.presets import PRESETS

    p = argparse.ArgumentParser(prog="python -m harness.speed.knob_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--knob", required=True, help="name=value, e.g. logits_chunk=none")
    p.add_argument("--presets", default=None,
                   help="preset names, each a decoder with the knob (default: those of `make regress` whose decoder "
                        "has it)")
    p.add_argument("--limit", type=int, default=ab.AB_LIMIT, help="test items per kind (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--out", default=None, help="JSON file (default: results/knob_ab_<knob>.json)")
    ns = p.parse_args(argv)
    try:
        knob, value = knob_value(ns.knob)
        text = ns.presets
        if text is None:
            from harness.run.presets import REGRESS_MODELS
            from refusion.decoding import DECODERS

            text = ",".join(p for p in REGRESS_MODELS if knob in DECODERS[PRESETS[p].decoder].knobs.names())
            if not text:
                raise ValueError(f"no preset of `make regress` has the knob {knob!r}; name presets with --presets")
        presets = ab.preset_names(text, ns.rounds, ns.limit)
        out = run(presets, knob, value, ns.limit, ns.rounds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = ns.out or f"results/knob_ab_{knob}.json"
    atomic_write_json(path, out)
    print(f"{out['sides']['current']} against the presets' knobs ({out['rounds']} rounds, {out['machine']['cpu']}):")
    for r in out["rows"]:
        print(f"{ab.row_line(r)}  same tokens: {r['same_tokens']}")
    print(f"wrote {path} in {out['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
