"""The timed rounds of a run (`harness eval`, docs/design.md "Timing protocol"), in their own process:

    python -m harness.run.rounds --run-dir D

Started by the runner once every model's decoding pass is done. It reads the run's settings (run.json
``timing``) and each model's per-sample logs, draws the timed items of every task (harness/run/timing.py
``sample_docs``: the same documents for every model), loads the models with the quality pass's own
settings (checkpoint, decoder, knobs, dtype, threads, batch size, chat template) and times them in
interleaved rounds (``timing.run_rounds``). Every timed decode must give the quality pass's tokens: a
mismatch stops with one ``error:`` line naming the model and the document.

Memory: with ``--timing-memory all`` every model of the run is loaded at once and each round visits them
all; with ``pairs`` the reference row (the run's speedup baseline) stays loaded and every other row is timed
against it, two models at a time, in a pass of its own (nine 8B rows do not fit one GPU together).
``auto`` (the default) picks ``all`` when the weights, with room to spare, fit the free memory of the
device. The choice is written to timing.json and run.json.

Writes ``timing.json`` (atomically) in the run folder: the settings, the timed documents, every block's
wall and CPU seconds and tokens, the guard's view of the machine. Nothing else of the run changes here;
the runner's ``finalize`` turns it into figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

from harness.run.store import atomic_write_json, read_json, read_json_or_none
from harness.run import guard as guard_mod, timing

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def settings_of(cfg: dict) -> dict:
    """The run's timing settings (run.json ``timing``), with the defaults of an older run.json."""
    t = dict(cfg.get("timing") or {})
    t.setdefault("mode", "interleaved")
    t.setdefault("rounds", timing.EVAL_ROUNDS)
    t.setdefault("items", timing.DEFAULT_ITEMS)
    t.setdefault("order", "abba")
    t.setdefault("memory", "auto")
    t.setdefault("busy_share", guard_mod.BUSY_SHARE)
    return t


def _rows(run_dir: Path, model: str, unit: str) -> dict[tuple[str, object], dict]:
    """The decoded (not failed) generation rows of one (model, unit) by (leaf task, document)."""
    p = run_dir / "models" / model / "samples" / f"{unit}.jsonl"
    out: dict[tuple[str, object], dict] = {}
    if not p.is_file():
        return out
    with open(p, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("failed") or r.get("tokens") is None or r.get("prompt") is None:
                continue
            out.setdefault((r["task"], r["doc_id"]), r)  # one row per filter: the decode is the same
    return out


def timed_docs(run_dir: Path, cfg: dict, t: dict) -> dict[str, list[tuple[str, object]]]:
    """Per unit with generation requests, the timed (leaf, document) pairs: a seeded sample of the documents
    every model decoded (module doc), rounded up to whole batches of the run's batch size."""
    common_of = {}
    for u in cfg["units"]:
        common = None
        for m in cfg["models"]:
            rows = _rows(run_dir, m["name"], u["name"])
            common = set(rows) if common is None else common & set(rows)
        if common:
            common_of[u["name"]] = sorted(common, key=lambda k: (k[0], f"{k[1]:012d}" if isinstance(k[1], int)
                                                                 else str(k[1])))
    items = t["items"]

    bs = max(1, int(cfg.get("batch_size") or 1))

    def k_of(docs: list) -> int | None:
        if items == "all":
            return None
        k = int(items) if items != "auto" else timing.items_auto(len(docs), int(t.get("rounds") or timing.EVAL_ROUNDS))
        # Whole batches: at --batch-size B a timed call is a batch of B, as in the pass (a call of fewer rows
        # would time another workload than the run's).
        return -(-k // bs) * bs
    return {u: timing.sample_docs(docs, k_of(docs), int(cfg["seed"]), u) for u, docs in common_of.items()}


def _weight_bytes(m: dict) -> int:
    total = 0
    for folder in (m["checkpoint"], m.get("base")):
        if folder and Path(folder).is_dir():
            total += sum(p.stat().st_size for p in Path(folder).iterdir() if p.suffix in WEIGHT_SUFFIXES)
    return total


def _free_bytes(device: str) -> int | None:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_mode(cfg: dict, t: dict) -> str:
    """all or pairs (module doc): ``auto`` is ``all`` when the weights take at most half the free memory."""
    if t["memory"] in ("all", "pairs"):
        return t["memory"]
    free = _free_bytes(cfg["device"])
    need = sum(_weight_bytes(m) for m in cfg["models"])
    return "all" if free is None or 2 * need <= free else "pairs"


class ModelSide:
    """One model of the run as a timing side: its prepared requests per unit, in batches of the run's batch
    size, and the quality pass's tokens to check every timed decode against."""

    def __init__(self, spec: dict, cfg: dict, rows: dict[str, list[dict]], run_dir: Path = Path(".")) -> None:
        from harness.run.lm_adapter import RefusionBenchLM, attach_engine

        self.name = spec["name"]
        self.lm = RefusionBenchLM(
            pretrained=spec["checkpoint"], decoder=spec["decoder"], batch_size=cfg["batch_size"],
            device=cfg["device"], seed=cfg["seed"], threads=cfg["threads"], journal_dir=None,
            task_knobs=spec["task_knobs"], dtype=cfg.get("dtype", "float32"), base=spec.get("base"),
            chat_template_args=spec.get("chat_template_args", cfg.get("chat_template_args")) or None,
            response_extract="python_fence" if cfg.get("prompts") == "paper" else None, **spec["knobs"])
        attach_engine(self.lm, spec.get("engine"), str(run_dir / "models" / spec["name"] / "engine-rounds.log"))
        self.quiet_s: list[float] = []  # an engine row: seconds waited for its server to go idle, per block
        self.expected: dict[tuple[str, object], list[int]] = {}
        self.batches: dict[str, list[list[dict]]] = {}
        self.dropped: dict[tuple[str, int], dict] = {}  # (group, call) -> the call's documents and its fault
        self.retried: list[dict] = []  # calls whose first attempt met a fault and whose retry ran
        bs = max(1, int(cfg["batch_size"]))
        for unit, rs in rows.items():
            items = []
            for i, r in enumerate(rs):
                self.expected[(r["task"], r["doc_id"])] = [int(x) for x in r["tokens"]]
                items.append({"key": f"timed/{r['task']}/{r['doc_id']}", "context": r["prompt"], "until": [],
                              "knobs": r["knobs"], "task": r["task"], "doc_id": r["doc_id"], "idx": i})
            self.batches[unit] = [items[j:j + bs] for j in range(0, len(items), bs)]

    def decode(self, batch: list[dict], what: str) -> list[dict]:
        """One decoder call of a batch of prepared requests; TimingMismatch unless every row gives its decoding
        pass's tokens (``what`` names the pass: timed, memory)."""
        recs = self.lm.call.run(batch, rank=0)
        for rec in recs:
            want = self.expected[(rec["task"], rec["doc_id"])]
            if rec["tokens"] != want:
                at = next((i for i, (a, b) in enumerate(zip(rec["tokens"], want)) if a != b),
                          min(len(rec["tokens"]), len(want)))
                raise timing.TimingMismatch(
                    f"model {self.name!r}: the {what} decode of {rec['task']} document {rec['doc_id']} gave "
                    f"other tokens than its decoding pass (first difference at token {at}: "
                    f"{len(rec['tokens'])} vs {len(want)} tokens); figures of other tokens would not be this run's")
        return recs

    def _call(self, group: str, ci: int) -> dict:
        """One timed call: wall and CPU seconds, tokens and rows; a call that met an item fault (out of memory,
        non-finite logits: harness/run/faults.py) is retried once, and one that fails again is dropped from the
        timing for the rest of the rounds (``dropped``: its documents and why). A timed decode of other tokens
        than the pass's (TimingMismatch) is not a fault: it stops the rounds."""
        from harness.run.faults import free_device_memory, item_fault

        batch = self.batches[group][ci]
        if (group, ci) in self.dropped:
            return {"failed": self.dropped[(group, ci)]["reason"], "rows": len(batch)}
        for attempt in (1, 2):
            try:
                recs = self.decode(batch, "timed")
                return {"wall_s": recs[0]["batch_wall_s"], "cpu_s": sum(r["cpu_s"] for r in recs),
                        "tokens": sum(r["generated_tokens"] for r in recs), "rows": len(recs)}
            except timing.TimingMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - classified by item_fault; anything else is a bug and stops
                why = item_fault(e)
                if why is None:
                    raise
                free_device_memory()
                if attempt == 1:
                    self.retried.append({"group": group, "docs": [[it["task"], it["doc_id"]] for it in batch],
                                         "reason": why})
                    continue
                self.dropped[(group, ci)] = {"group": group, "side": self.name, "reason": why,
                                             "docs": [[it["task"], it["doc_id"]] for it in batch]}
        return {"failed": self.dropped[(group, ci)]["reason"], "rows": len(batch)}

    def block(self, group: str, repeat: int) -> list[dict]:
        engine = getattr(self.lm, "engine", None)  # an engine row's server (lm_adapter.attach_engine)
        if engine is not None:
            # vLLM's CPU worker spins for about a second after each step: wait (outside every clock) until its
            # server is idle before the block, so its own block starts from rest, and after it, so the next
            # row's block is not timed beside a busy server (docs/engines.md "Fairness").
            self.quiet_s.append(engine.wait_quiet())
        calls = self._block(group, repeat)
        if engine is not None:
            self.quiet_s.append(engine.wait_quiet())
        return calls

    def _block(self, group: str, repeat: int) -> list[dict]:
        calls: list[dict] = []
        for rep in range(repeat):
            for ci in range(len(self.batches[group])):
                call = self._call(group, ci)
                if rep == 0:
                    calls.append(call)
                elif "failed" in call or "failed" in calls[ci]:
                    calls[ci] = {"failed": call.get("failed") or calls[ci]["failed"], "rows": call["rows"]}
                else:
                    calls[ci]["wall_s"] += call["wall_s"]
                    calls[ci]["cpu_s"] += call["cpu_s"]
        return calls

    def close(self) -> None:
        from harness.run.lm_adapter import close_engine

        close_engine(self.lm)
        del self.lm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass


def load_timing(run_dir: Path, cfg: dict) -> dict | None:
    """The run's timing.json when the run is interleaved and it was written for the run's timing settings (with
    no passes when no task of the run generates text: its ``why`` says so)."""
    t = settings_of(cfg)
    got = read_json_or_none(run_dir / "timing.json") if t["mode"] == "interleaved" else None
    return got if isinstance(got, dict) and got.get("settings") == t and (got.get("passes") or got.get("why")) \
        else None


def _pass_of(timed: dict, model: str) -> dict | None:
    """The pass that timed ``model`` (in pairs mode the reference is in every pass: its first)."""
    return next((p for p in timed["passes"] if model in p["sides"]), None)


def _single(r: dict, why: str, mode: str = "single pass") -> None:
    r["speed"]["timing"] = {"mode": mode, "rounds": 1, "why": why}
    if r.get("speedup"):
        r["speedup"]["source"] = "single pass"


def apply_timing(timed: dict | None, cfg: dict, rows: list[dict]) -> dict:
    """Put the timed rounds' figures into the metrics rows, or mark every row as a single pass. From the rounds:
    tokens/s and the speedup, each with its interval (harness/run/timing.py), and the mean request latency beside
    them (``speed.timing``); the decoding pass's own tokens/s is kept under ``speed.single_pass``, and the latency
    percentiles stay the pass's, over every decoded item. A row the rounds could not time keeps its single-pass
    figures and says so (``speedup.source``, ``speed.timing.why``). Returns the run's timing summary: mode,
    rounds, items, memory, the guard, the busy flag, what was dropped, and per model its mean speedup (point and
    interval of one statistic, ``timing.mean_ratio``)."""
    t = settings_of(cfg)
    if timed is None or not timed.get("passes"):
        why = ("--timing sequential" if t["mode"] == "sequential" else
               f"{timed['why']}" if timed and timed.get("why") else
               "no timed rounds in this run folder (merged shards, or an older run)")
        for r in rows:
            _single(r, why, "sequential" if t["mode"] == "sequential" else "single pass")
        return {"mode": "single pass", "why": why, "busy": False, "mean_speedup": {}}
    base = cfg.get("baseline")
    guards = [p.get("guard") for p in timed["passes"] if p.get("guard")]
    state = guard_mod.combined_state(guards)
    guard = max(guards, key=lambda g: g.get("others_share") or 0.0) if guards else None
    dropped = timed.get("dropped") or []
    for r in rows:
        ps = _pass_of(timed, r["model"])
        fig = timing.figure(ps["records"], r["model"], r["task"]) if ps else None
        if fig is None:  # no generation in this task, a model the rounds did not see, or every timed item dropped
            lost = [d for d in dropped if d["group"] == r["task"]]
            _single(r, "every timed item failed twice in the rounds" if lost else "no timed items for this task")
            continue
        s = r["speed"]
        s["single_pass"] = {"tokens_per_s": s["tokens_per_s"]["ratio_of_sums"]}
        s["tokens_per_s"] = {"ratio_of_sums": fig["tokens_per_s"], "mean_of_ratios": fig["mean_of_ratios"],
                             "cpu_time": fig["cpu_tokens_per_s"]}
        left = {tuple(x) for d in dropped if d["group"] == r["task"] for x in d["docs"]}
        s["timing"] = {"mode": "interleaved", "rounds": fig["rounds"], "items": fig["rows"], "calls": fig["calls"],
                       "timed_tokens": fig["tokens"], "per_round_tokens_per_s": fig["per_round"],
                       "latency_s": fig["latency_s"], "per_round_latency_s": fig["per_round_latency_s"],
                       "docs": [list(k) for k in timed["docs"].get(r["task"], []) if tuple(k) not in left],
                       "dropped": [list(k) for k in sorted(left, key=str)],
                       "memory": timed.get("memory"), "busy": bool((ps.get("guard") or {}).get("busy")),
                       "machine": guard_mod.state_of(ps.get("guard"))}
        iv = r.setdefault("intervals", {})
        iv["tokens_per_s"] = fig["interval"]
        iv["timed_latency_s"] = fig["latency_interval"]
        if base and r["model"] != base and (r.get("speedup") or {}).get("baseline") == base:
            q = timing.ratio(ps["records"], r["model"], base, r["task"])
            if q is None:
                r["speedup"]["source"] = "single pass"
                continue
            r["speedup"] = {"baseline": base, "tokens_per_s": q["ratio"], "interval": q["interval"], "p": None,
                            "items": fig["rows"], "pairs": q["pairs"], "rounds": q["rounds"],
                            "source": "timed rounds", "statistic": q["statistic"], "per_pair": q["per_pair"],
                            "per_item": q["per_item"]}
    means = {}
    if base:
        for m in cfg["models"]:
            ps = _pass_of(timed, m["name"])
            mine = [r for r in rows if r["model"] == m["name"] and (r.get("speedup") or {}).get("tokens_per_s")]
            if m["name"] == base or not ps or base not in ps["sides"] or not mine:
                continue
            if all(r["speedup"].get("source") == "timed rounds" for r in mine):
                got = timing.mean_ratio(ps["records"], m["name"], base, [r["task"] for r in mine])
                if got is not None:
                    means[m["name"]] = {k: got[k] for k in ("ratio", "interval", "statistic")}
    counts = sorted({len(v) for v in (timed.get("docs") or {}).values()})
    return {"mode": "interleaved", "rounds": t["rounds"], "order": t["order"], "items_setting": t["items"],
            "items": counts[0] if len(counts) == 1 else "-".join(map(str, (counts[0], counts[-1]))),
            "pairs": timing.pairs_text(int(t["rounds"])),
            "memory": timed.get("memory"), "busy": state == "busy", "machine": state, "guard": guard,
            "busy_text": guard_mod.busy_text(guard), "machine_text": guard_mod.state_text(guards),
            "dropped": dropped, "retried": len(timed.get("retried") or []),
            "clock": timed.get("clock"), "seconds": timed.get("seconds"), "mean_speedup": means}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.run.rounds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--no-progress", action="store_true")
    ns = p.parse_args(argv)
    run_dir = Path(ns.run_dir)
    cfg = read_json(run_dir / "run.json")
    t = settings_of(cfg)
    from harness.run.lm_adapter import set_seed
    from harness.run.quiet import quiet_libraries

    quiet_libraries()
    set_seed(cfg["seed"])
    t0 = time.monotonic()
    docs = timed_docs(run_dir, cfg, t)
    groups = list(docs)
    if not groups:
        atomic_write_json(run_dir / "timing.json", {"settings": t, "docs": {}, "passes": [], "memory": None,
                                                    "why": "no task of the run generates text: nothing to time"})
        return 0
    rows = {}
    for m in cfg["models"]:
        logs = {u: _rows(run_dir, m["name"], u) for u in docs}  # each sample log read once
        rows[m["name"]] = {u: [logs[u][k] for k in ks] for u, ks in docs.items()}
    names = [m["name"] for m in cfg["models"]]
    ref = cfg.get("baseline") if cfg.get("baseline") in names else names[0]
    mode = memory_mode(cfg, t)
    specs = {m["name"]: m for m in cfg["models"]}
    gpu = None
    if str(cfg["device"]).startswith("cuda"):
        gpu = int(str(cfg["device"]).split(":")[1]) if ":" in str(cfg["device"]) else 0
    plan = [names] if mode == "all" or len(names) < 2 else [[ref, n] for n in names if n != ref]
    passes: list[dict] = []
    dropped: list[dict] = []  # calls that failed twice: their documents, the side and the fault
    retried: list[dict] = []  # calls whose first attempt failed and whose retry ran
    loaded: dict[str, ModelSide] = {}
    try:
        for i, members in enumerate(plan):
            for n in list(loaded):
                if n not in members:
                    loaded.pop(n).close()
            for n in members:
                if n not in loaded:
                    loaded[n] = ModelSide(specs[n], cfg, rows[n], run_dir)
            guard = guard_mod.Guard(busy_share=float(t["busy_share"]), gpu_index=gpu)
            desc = "timed rounds" + (f" ({n} vs {ref})" if len(plan) > 1 else "")
            got = timing.run_rounds([loaded[n] for n in members], groups, rounds=int(t["rounds"]), order=t["order"],
                                    seed=int(cfg["seed"]), guard=guard, progress=not ns.no_progress, desc=desc)
            # A call one side could not time (a fault twice) is left out for every side of its group.
            got["records"], left_out = timing.drop_failed(got["records"])
            passes.append({"sides": members, **got, "left_out_calls": left_out})
            for n in members:
                dropped += [d for d in loaded[n].dropped.values() if d not in dropped]
                retried += [x for x in loaded[n].retried if x not in retried]
    except timing.TimingMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    finally:
        from harness.run.lm_adapter import close_engine

        for side in loaded.values():  # engine servers stopped on every way out (also at exit)
            close_engine(side.lm)
    quiet = {n: round(sum(s.quiet_s), 1) for n, s in loaded.items() if s.quiet_s}
    device = str(cfg["device"])
    atomic_write_json(run_dir / "timing.json", {
        "settings": t, "docs": {u: [list(k) for k in ks] for u, ks in docs.items()}, "reference": ref,
        "memory": mode, "passes": passes, "seconds": round(time.monotonic() - t0, 1),
        "dropped": dropped, "retried": retried, **({"engine_quiet_wait_s": quiet} if quiet else {}),
        "clock": ("wall time, the device synchronised at the edges of every call; CPU time beside it"
                  if device.startswith("cuda") else "wall time; the process's CPU time beside it")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
