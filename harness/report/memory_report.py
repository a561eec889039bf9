"""The report's memory page (memory.md): each decoder's peak decode memory in the runs, split into KV cache,
logits and other, beside its weights; and the estimate at the released sizes (results/memory_estimate.json,
harness/speed/memory_estimate.py) beside the memory claim made for ReFusion."""

from __future__ import annotations

from pathlib import Path

from harness.run.store import read_json

REPO = Path(__file__).resolve().parents[2]
RELEASED = REPO / "results" / "memory_estimate.json"
# What a widely read summary of the paper says (the arXiv abstract gives no figure): KV-cache reuse lowers peak
# GPU memory by about 40% against the masked-diffusion baselines.
CLAIM = 0.40
MDM_DECODERS = ("llada", "dream")


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:.2f}"


def _gib(v) -> str:
    return "-" if v is None else f"{v / 2**30:.2f}"


def runs_table(rs) -> list[str]:
    """One row per (model, task) the runs measured with a memory pass; [] when none did."""
    rows = []
    for (label, unit), met in rs.metrics.items():
        mem = met.get("memory") or {}
        if mem.get("decode_peak_bytes") is None:
            continue
        b = mem.get("decode_breakdown") or {}
        rows.append(f"| {label} | {unit} | {_mib(mem['decode_peak_bytes'])} | {_mib(b.get('kv_cache'))} | "
                    f"{_mib(b.get('logits'))} | {_mib(b.get('other'))} | {_mib(mem.get('weights_bytes'))} | "
                    f"{mem.get('decode_calls', '-')} |")
    if not rows:
        return []
    return ["## Peak decode memory in these runs", "",
            "The memory pass's figure: the largest, over its calls, of the tensor bytes one decoder call held at "
            "once above what was live when it began (on CUDA the allocator's peak, weights excluded), split at "
            "that moment. Allocator caching, kernels' scratch memory, the interpreter and libraries are not in it.",
            "", "| model | task | decode peak MiB | KV cache | logits | other | weights MiB | calls |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


def _cell(entry: dict) -> str:
    """An estimate's peak in GiB, with its ratio to the floor where the file has one."""
    ratio = entry.get("over_floor")
    return _gib(entry.get("peak_bytes")) + (f" ({ratio:.2f}x floor)" if ratio is not None else "")


def released_table(path: Path = RELEASED) -> list[str]:
    """The released-size estimate with ReFusion's peak over each MDM baseline's, beside the claim; [] without
    the file."""
    if not path.is_file():
        return []
    data = read_json(path)
    s = data.get("settings") or {}
    batches = [str(b) for b in s.get("batches") or ("1", "8")]
    lines = ["## Memory at released size (estimate, no weights loaded)", "",
             f"Each released architecture built from its config under FakeTensorMode, every decoder phase at its "
             f"largest shape through the same tracker (`python -m harness.speed.memory_estimate`, "
             f"`{path.relative_to(REPO) if path.is_relative_to(REPO) else path}`): prompt {s.get('prompt')}, "
             f"{s.get('gen')} new tokens. GiB, weights excluded; beside each, the peak over the decoder's floor (its "
             f"KV cache, the activations of its largest forward and one chunk of logits); a decoder with the knob "
             f"logits_chunk (default {s.get('logits_chunk')}) also with it none (the LM head over every position).", "",
             "| model | decoder | weights GiB | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]
    peak: dict[str, dict[str, int]] = {}
    for model, v in (data.get("models") or {}).items():
        for dec, per in (v.get("decoders") or {}).items():
            cells = [_cell(per.get(b) or {}) for b in batches]
            lines.append(f"| {model} | {dec} | {_gib(v.get('weights_bytes'))} | " + " | ".join(cells) + " |")
            if all("full" in (per.get(b) or {}) for b in batches):
                cells = [_cell(per[b]["full"]) for b in batches]
                lines.append(f"| {model} | {dec}, logits_chunk none | {_gib(v.get('weights_bytes'))} | "
                             + " | ".join(cells) + " |")
            if dec == "refusion" or dec in MDM_DECODERS:
                peak[dec] = {b: (per.get(b) or {}).get("peak_bytes") for b in batches}
    if "refusion" in peak:
        lines += ["", f"The claim (a summary of the paper): about {CLAIM:.0%} lower peak memory than the masked-"
                      "diffusion baselines. This estimate, ReFusion's decode peak against each:", ""]
        for dec in MDM_DECODERS:
            if dec in peak:
                parts = []
                for b in batches:
                    r, m = peak["refusion"].get(b), peak[dec].get(b)
                    if r and m:
                        parts.append(f"batch {b}: {100 * (r / m - 1):+.0f}%")
                lines.append(f"- vs {dec}: " + ", ".join(parts))
    return lines + [""]


def memory_md(rs) -> str | None:
    """The page, or None when there is nothing to show."""
    body = runs_table(rs) + released_table()
    return "\n".join(["# Memory", "", *body]) if body else None
