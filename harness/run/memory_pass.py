"""The memory pass of a run (`harness eval`, docs/design.md §6 "Peak decode memory"), in its own process:

    python -m harness.run.memory_pass --run-dir D

Started by the runner after the decoding pass and the timed rounds. Per task it draws the memory items: the
first ``k`` documents (``--memory-items``, run.json ``memory_pass.items``) of the seeded shuffle the timed
rounds draw from (harness/run/timing.py ``sample_docs``: the run's seed and the task's name), among the
documents every model decoded; with ``--batch-size`` B it takes k x B items, k calls of B rows. Each model is
loaded alone (its weights are then the process's only ones), makes one untracked warm-up call, and decodes
every memory item once more under the tracker of harness/run/memory.py; each decode must give the decoding
pass's tokens.

The figure of a (model, task) is the largest peak over its calls, with that call's breakdown (KV cache,
logits, other) and items, and the largest ``retained_bytes`` (what a call left live when it ended: its
outputs and anything it leaked, which a leak smaller than the peak's transient still shows); on the CPU it is the bytes of tensor storages the call held at once above what was
live when it began, the same on every run and every machine with the same versions. A call that fails (out
of memory, non-finite logits) is retried once, then named and left out; the process still exits 0.

Writes ``memory.json`` (atomically) in the run folder; the runner's ``finalize`` puts it into the metrics.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.run.store import atomic_write_json, read_json, read_json_or_none

DEFAULT_ITEMS = 2  # memory items (calls) per task: the tracker costs several times a plain decode on the CPU


def settings_of(cfg: dict) -> dict:
    """The run's memory-pass settings (run.json ``memory_pass``), with the defaults of an older run.json."""
    m = dict(cfg.get("memory_pass") or {})
    m.setdefault("items", DEFAULT_ITEMS)
    return {**m, "batch_size": int(cfg.get("batch_size") or 1)}


def load_memory(run_dir: Path, cfg: dict) -> dict | None:
    """The run's memory.json when it was measured with the run's settings."""
    got = read_json_or_none(run_dir / "memory.json")
    return got if isinstance(got, dict) and got.get("settings") == settings_of(cfg) else None


def _measure(side, batches: list[list[dict]]) -> dict:
    """One model's figure on one task: the largest call peak with its breakdown, every call's peak, the items
    measured and those that failed twice. Only an item fault (harness/run/faults.py: out of memory, non-finite
    logits, a forward budget) is retried and named; anything else is a bug and stops the pass."""
    from harness.run.faults import free_device_memory, item_fault

    calls, failed = [], []
    for batch in batches:
        items = [[it["task"], it["doc_id"]] for it in batch]
        for attempt in (1, 2):
            try:
                side.decode(batch, "memory")
                break
            except Exception as e:  # noqa: BLE001 - classified by item_fault; the rest is re-raised
                why = item_fault(e)
                if why is None:
                    raise
                free_device_memory()
                if attempt == 2:
                    failed.append({"items": items, "error": why.replace("\n", " ")[:300]})
        else:
            continue
        mem = side.lm.call.last_memory
        calls.append({"items": items, "peak_bytes": int(mem["peak_bytes"]), "breakdown": mem["breakdown"],
                      "retained_bytes": int(mem["retained_bytes"])})
    out = {"failed": failed, "calls": [{k: c[k] for k in ("items", "peak_bytes", "retained_bytes")} for c in calls]}
    if calls:
        top = max(calls, key=lambda c: c["peak_bytes"])
        mem = side.lm.call.last_memory
        out.update(decode_peak_bytes=top["peak_bytes"], breakdown=top["breakdown"], peak_items=top["items"],
                   retained_bytes=max(c["retained_bytes"] for c in calls),
                   weights_bytes=int(mem["weights_bytes"]), method=mem["method"], leaves_out=mem["leaves_out"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.run.memory_pass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the run folder (its run.json and per-sample logs)")
    p.add_argument("--no-progress", action="store_true", help="no progress line per model")
    ns = p.parse_args(argv)
    run_dir = Path(ns.run_dir)
    cfg = read_json(run_dir / "run.json")
    settings = settings_of(cfg)
    from harness.run import rounds, timing

    k = int(settings["items"]) * settings["batch_size"]
    docs = rounds.timed_docs(run_dir, cfg, {"items": k, "rounds": 1})
    result: dict = {"settings": settings, "docs": {u: [list(d) for d in v] for u, v in docs.items()}, "models": {}}
    for m in cfg["models"]:
        if m.get("engine"):  # its decode memory lives in the server's processes, out of this tracker's sight
            result.setdefault("skipped", {})[m["name"]] = "engine row: the server holds the decode memory"
            continue
        if (m.get("knobs") or {}).get("compile") and not str(cfg.get("device") or "cpu").startswith("cuda"):
            # torch.compile skips every frame under a dispatch mode, and off CUDA no allocator counts instead
            why = "compiled decoding off CUDA: the tensor tracker cannot see compiled forwards"
            result.setdefault("skipped", {})[m["name"]] = why
            if not ns.no_progress:
                print(f"memory pass: {m['name']} skipped ({why}: decode it with compile=false for its eager peak)",
                      file=sys.stderr, flush=True)
            continue
        rows = {}
        for u, keys in docs.items():
            by_key = rounds._rows(run_dir, m["name"], u)
            rows[u] = [by_key[key] for key in keys if key in by_key]
        if not ns.no_progress:
            print(f"memory pass: {m['name']} ({sum(len(v) for v in rows.values())} item(s))", file=sys.stderr,
                  flush=True)
        side = rounds.ModelSide(m, cfg, rows)
        side.lm.call.memory = True
        try:
            result["models"][m["name"]] = {u: _measure(side, side.batches[u]) for u in rows if side.batches[u]}
        except timing.TimingMismatch as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            side.close()
        failed = [f for per in result["models"][m["name"]].values() for f in per["failed"]]
        for f in failed:
            print(f"warning: memory pass: model {m['name']!r}, items {f['items']}: {f['error']}; left out of its "
                  "peak", file=sys.stderr)
    atomic_write_json(run_dir / "memory.json", result)
    return 0


def apply_memory(run_dir: Path, cfg: dict, rows: list[dict]) -> dict | None:
    """Put the memory pass's figures into the metrics rows (``memory.decode_peak_bytes``, its breakdown, the
    weights' bytes, the items); the loaded memory.json, or None when the run has none."""
    got = load_memory(run_dir, cfg)
    for r in rows:
        per = ((got or {}).get("models") or {}).get(r["model"], {}).get(r["task"])
        mem = r.setdefault("memory", {})
        for key in ("decode_peak_bytes", "decode_breakdown", "weights_bytes", "decode_items", "decode_method",
                    "decode_failed", "decode_retained_bytes", "decode_calls"):
            mem.pop(key, None)
        if per and per.get("decode_peak_bytes") is not None:
            mem.update(decode_peak_bytes=per["decode_peak_bytes"], decode_breakdown=per["breakdown"],
                       weights_bytes=per["weights_bytes"], decode_items=per["peak_items"],
                       decode_retained_bytes=per["retained_bytes"],
                       decode_method=per["method"], decode_calls=len(per["calls"]))
        if per and per.get("failed"):
            mem["decode_failed"] = per["failed"]
    return got


if __name__ == "__main__":
    raise SystemExit(main())
