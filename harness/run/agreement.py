"""Greedy agreement of each engine row with the run's transformers AR row (docs/engines.md "Agreement").

Both rows decode the same prompts greedily on the same checkpoint, so their tokens should be equal; where an
item differs, the first differing position is found and the transformers model's logits there (the prompt
as the adapter encodes it, plus the common prefix of the two answers) must show a near-tie: a top-2 margin
below ``TIE_BOUND[dtype]`` (float32 0.01, bfloat16 0.5: one step of bfloat16's 8-bit mantissa at a logit of
about 20-60). A difference at a clear margin is a real disagreement (another chat template, stop rule or
sampling setting), and the check fails.

    check(run_dir, cfg)  ->  {"pairs": [{"engine", "reference", "items", "equal", "share", "differences":
                              [{"task", "doc_id", "position", "margin", "near_tie"}], "ok"}], "bound": ...}

Written to ``agreement.json`` in the run folder by the runner's finalize; the summary shows one line per pair.
The model is loaded only when some item differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TIE_BOUND = {"float32": 0.01, "bfloat16": 0.5, "float16": 0.1}  # top-2 logit margin counted as a near-tie
MIN_SHARE = 0.95  # the share of equal items below which the engine row is not the same AR decoding


def _rows(run_dir: Path, model: str, unit: str) -> dict[tuple[str, Any], dict]:
    p = run_dir / "models" / model / "samples" / f"{unit}.jsonl"
    out: dict[tuple[str, Any], dict] = {}
    if p.is_file():
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("tokens") is not None and not r.get("failed"):
                    out.setdefault((r["task"], r["doc_id"]), r)
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a longer list differs at the shorter's end); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def margins(folder: str, dtype: str, device: str, cases: list[tuple[str, list[int]]]) -> list[float]:
    """The top-2 logit margin of the transformers model at the end of each (prompt text, answer prefix)."""
    import torch

    from harness.models.checkpoints import load_model

    loaded = load_model(folder, device=device, dtype=dtype)
    out = []
    with torch.no_grad():
        for text, prefix in cases:
            ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"]) + list(prefix)
            logits = loaded.model(torch.tensor([ids], device=device)).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            out.append(float(top[0] - top[1]))
    return out


def check(run_dir: Path, cfg: dict) -> dict | None:
    """Agreement of every engine row with the run's baseline AR row (module doc); None without an engine row."""
    base = cfg.get("baseline")
    ref = next((m for m in cfg["models"] if m["name"] == base and m["decoder"] == "ar" and not m.get("engine")), None)
    engines = [m for m in cfg["models"] if m.get("engine")]
    if not engines or ref is None:
        return None
    dtype = str(cfg.get("dtype", "float32"))
    bound = TIE_BOUND.get(dtype, 0.5)
    pairs = []
    for eng in engines:
        items, equal, diffs, cases = 0, 0, [], []
        for u in cfg["units"]:
            mine, theirs = _rows(run_dir, eng["name"], u["name"]), _rows(run_dir, ref["name"], u["name"])
            for key in sorted(set(mine) & set(theirs), key=str):
                items += 1
                a, b = [int(t) for t in mine[key]["tokens"]], [int(t) for t in theirs[key]["tokens"]]
                at = first_difference(a, b)
                if at is None:
                    equal += 1
                    continue
                diffs.append({"task": key[0], "doc_id": key[1], "position": at, "engine_token": a[at] if at < len(a)
                              else None, "ar_token": b[at] if at < len(b) else None})
                cases.append((theirs[key]["prompt"], b[:at]))
        if cases:
            device = "cuda" if str(cfg.get("device", "cpu")).startswith("cuda") else "cpu"
            for d, m in zip(diffs, margins(ref["checkpoint"], dtype, device, cases)):
                d["margin"], d["near_tie"] = m, m < bound
        share = equal / items if items else 0.0
        pairs.append({"engine": eng["name"], "reference": ref["name"], "items": items, "equal": equal,
                      "share": share, "differences": diffs,
                      "ok": bool(items) and share >= MIN_SHARE and all(d["near_tie"] for d in diffs)})
    return {"bound": bound, "dtype": dtype, "min_share": MIN_SHARE, "pairs": pairs,
            "rule": f"greedy tokens equal on >= {MIN_SHARE:.0%} of items; every difference at a transformers top-2 "
                    f"logit margin below {bound} ({dtype})"}


def lines(agreement: dict | None) -> list[str]:
    """One summary line per engine row, with every difference and its margin."""
    out = []
    for p in (agreement or {}).get("pairs", []):
        diffs = "; ".join(f"{d['task']} document {d['doc_id']} at token {d['position']} (margin "
                          f"{d.get('margin', float('nan')):.4f}{'' if d.get('near_tie') else ', NOT a near-tie'})"
                          for d in p["differences"])
        out.append(f"Agreement {p['engine']} vs {p['reference']}: {p['equal']}/{p['items']} items with the same "
                   f"greedy tokens ({100 * p['share']:.1f}%); {'ok' if p['ok'] else 'FAILED'} "
                   f"({agreement['rule']})" + (f"; differences: {diffs}" if diffs else ""))
    return out
