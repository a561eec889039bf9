"""One model of a run, in its own process: `python -m harness.run.worker --run-dir D --model NAME`.

Started by the runner (directly, or under ``accelerate launch`` for data
parallelism). It evaluates every task of the run with lm-eval and the
``refusion_bench`` adapter, then (rank 0) joins lm-eval's per-sample logs with the
decode journal and writes lm-eval's results, per-sample logs and one metrics JSON
per (model, task). A separate process per model makes its peak RSS that model's
alone. ``done.json`` is written last: its presence means the model is finished.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import sys
from pathlib import Path

from harness.run.metrics import aggregate, quality_metrics, withheld_verdicts
from harness.run.store import atomic_write_json, atomic_write_jsonl, read_json
from harness.run.zygote import die_with_parent


def _peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def _unit_quality(results: dict, unit: dict) -> dict:
    if unit["name"] in results and quality_metrics(results[unit["name"]]):
        return quality_metrics(results[unit["name"]])
    if len(unit["leaves"]) == 1 and unit["leaves"][0] in results:
        return quality_metrics(results[unit["leaves"][0]])
    return {}


# The metrics of tasks/hooks.py that run a program in the sandbox (pass_at_k reports "pass@1").
SANDBOX_METRICS = ("pass@1", "pass_at_1")


def _texts(value) -> list[str]:
    """The strings in a sample field (a response, a list of them, nested lists)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _texts(v)]
    return []


def _sample_rows(samples: dict, records: dict[tuple, dict], unit: dict) -> list[dict]:
    rows = []
    for leaf in unit["leaves"]:
        for s in samples.get(leaf, []):
            rec = records.get((leaf, s["doc_id"]), {})
            row = {"task": leaf, "doc_id": s["doc_id"], "target": s.get("target"),
                   "prompt": s["arguments"][0][0] if s.get("arguments") else None,
                   "response": rec.get("response"), "filtered_resps": s.get("filtered_resps"),
                   "filter": s.get("filter"), "metrics": {k: s[k] for k in s.get("metrics", []) if k in s}}
            for k in ("failed", "generated_tokens", "nfe", "tpf", "decode_s", "latency_s", "forward_s", "batch_size", "batch_id", "batch_wall_s", "kv_peak_bytes", "gpu_peak_bytes",
                      "prompt_tokens", "tokens", "knobs", "rank", "commit_forward", "commit_kind", "forward_phase",
                      "compiled", "compilations", "compile_s"):
                if k in rec:
                    row[k] = rec[k]
            row.update({k: v for k, v in rec.items() if k.startswith("nfe_")})
            if any(k in row["metrics"] for k in SANDBOX_METRICS):
                # Scored in the sandbox: where it withholds some of the evaluation's packages (no namespaces,
                # a private venv), a verdict on code that imports one of them is marked with its modules.
                from tasks.sandbox import withheld_imports

                modules = withheld_imports(*_texts(row["filtered_resps"]), *_texts(row["target"]))
                if modules:
                    row["sandbox_withheld"] = modules
            rows.append(row)
    rows.sort(key=lambda r: (r["task"], r["doc_id"], r.get("filter") or ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.run.worker", description=__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--error-file", default=None,
                   help="write a one-line error here (for the runner to report) instead of to stderr")
    p.add_argument("--debug", action="store_true", help="full traceback instead of the one-line error")
    p.add_argument("--retry-failed", action="store_true",
                   help="decode again the items an earlier session recorded as failed (out of memory, ...)")
    ns = p.parse_args(argv)
    try:
        return _main(ns)
    except Exception as e:  # noqa: BLE001 - sorted below: only the user's data and files get one line
        from harness.run.errors import known_error

        msg = None if ns.debug else known_error(e)
        if msg is None:
            raise
        if ns.error_file:
            from harness.run.store import atomic_write_text

            try:
                atomic_write_text(Path(ns.error_file), msg + "\n")
                return 2
            except OSError:  # a full disk takes the error file too: say it here (the runner adds nothing)
                msg += f"; fix it and rerun with --run-id {Path(ns.run_dir).name} to resume"
        # on a line of its own: this worker's progress bar may have been drawn without a newline just before
        print(f"\nerror: {msg}", file=sys.stderr)
        return 2


def _main(ns: argparse.Namespace) -> int:
    die_with_parent(signal.SIGKILL)  # the runner (or accelerate's launcher) gone: this worker must not keep writing
    # SIGTERM (and Slurm's warning signal, SIGUSR1) unwinds like an exception: open files close, the
    # journal keeps every finished sample. SIGINT already does (KeyboardInterrupt).
    from harness.run.faults import pause_at

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    run_dir = Path(ns.run_dir)
    cfg = read_json(run_dir / "run.json")
    spec = next((m for m in cfg["models"] if m["name"] == ns.model), None)
    if spec is None:
        print(f"error: model {ns.model!r} not in {run_dir}/run.json; valid: "
              f"{', '.join(m['name'] for m in cfg['models'])}", file=sys.stderr)
        return 2
    for name in ("lm_eval", "datasets", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from harness.run.quiet import quiet_libraries

    quiet_libraries()  # no per-task metadata hint, no weight-loading bar; warnings and errors stay
    mdir = run_dir / "models" / spec["name"]
    lm, res = _evaluate(cfg, spec, mdir, ns.retry_failed)
    from harness.run.lm_adapter import close_engine

    close_engine(lm)  # an engine row's server: stopped before the results are written (also at exit, on any signal)
    lm.barrier()
    # Every rank's keys, RSS and counts go to rank 0, which alone writes files.
    mine = {"keys": lm.keys_by_task, "peak_rss_bytes": _peak_rss_bytes(), "computed": lm.computed,
            "served": lm.served, "warmup_s": lm.warmup_s, "rank": lm.rank,
            "warmup_compile": lm.warmup_compile}
    ranks = lm.gather_object(mine, dst=0)
    if lm.journal is not None:
        lm.journal.close()
    if lm.rank != 0:
        return 0
    pause_at("results")  # a test hook: a stop signal between the journal and the metrics
    _write_results(run_dir, cfg, spec, res, lm.journal.load(), ranks)
    return 0


def _evaluate(cfg: dict, spec: dict, mdir: Path, retry_failed: bool = False):
    """(the lm-eval model, lm-eval's results) of one model of the run on every unit of it."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from harness.run.lm_adapter import RefusionBenchLM, attach_engine, set_seed

    set_seed(cfg["seed"])
    lm = RefusionBenchLM(
        pretrained=spec["checkpoint"], decoder=spec["decoder"], batch_size=cfg["batch_size"],
        device=cfg["device"], seed=cfg["seed"], threads=cfg["threads"], journal_dir=str(mdir / "journal"),
        task_knobs=spec["task_knobs"], dtype=cfg.get("dtype", "float32"), base=spec.get("base"),
        chat_template_args=spec.get("chat_template_args", cfg.get("chat_template_args")) or None,
        response_extract="python_fence" if cfg.get("prompts") == "paper" else None, retry_failed=retry_failed,
        **spec["knobs"])
    attach_engine(lm, spec.get("engine"), str(mdir / "engine.log"))  # ar@vllm: decoded by its server
    # The built-in tasks folder, then the run's --tasks-dir folders (runner.task_manager: later ones win).
    dirs = list(dict.fromkeys([cfg["tasks_dir"], *cfg.get("tasks_dirs", [])]))
    tm = TaskManager(include_path=dirs, include_defaults=False)
    from harness.run.cluster import shard_docs

    # A shard (--shard I/N) decodes its own documents of every leaf task, chosen from those LIMIT leaves.
    shard = cfg.get("shard")
    samples = {leaf: shard_docs(n, shard) for u in cfg["units"] for leaf, n in (u.get("docs") or {}).items()} \
        if shard else None
    res = lm_eval.simple_evaluate(
        model=lm, tasks=[u["name"] for u in cfg["units"]], task_manager=tm,
        limit=None if shard else cfg["limit"], samples=samples,
        apply_chat_template=cfg["chat_template"], log_samples=True, bootstrap_iters=cfg["bootstrap_iters"],
        random_seed=cfg["seed"], numpy_random_seed=cfg["seed"], torch_random_seed=cfg["seed"],
        fewshot_random_seed=cfg["seed"], confirm_run_unsafe_code=True)
    return lm, res


def _shard_doc_ids(cfg: dict, journal: dict[str, dict]) -> dict[str, dict]:
    """A shard's journal numbers its documents by position among the shard's own (lm-eval enumerates the
    selected documents), while lm-eval's sample log keeps their index in the task: the records get the
    task's index, so each sample row joins its own decode (and the shards' logs merge by document)."""
    shard = cfg.get("shard")
    if not shard:
        return journal
    from harness.run.cluster import shard_docs

    picks = {leaf: shard_docs(n, shard) for u in cfg["units"] for leaf, n in (u.get("docs") or {}).items()}
    out = {}
    for key, rec in journal.items():
        pos = rec.get("doc_id")
        if rec.get("task") in picks and isinstance(pos, int) and 0 <= pos < len(picks[rec["task"]]):
            rec = {**rec, "doc_id": picks[rec["task"]][pos]}
        out[key] = rec
    return out


def _write_results(run_dir: Path, cfg: dict, spec: dict, res: dict, journal: dict[str, dict],
                   ranks: list[dict]) -> None:
    """Rank 0: lm-eval's results, per unit the sample rows and the metrics file, then done.json."""
    mdir = run_dir / "models" / spec["name"]
    journal = _shard_doc_ids(cfg, journal)
    keys: dict[str, set[str]] = {}
    for r in ranks:
        for task, ks in r["keys"].items():
            keys.setdefault(task, set()).update(ks)
    samples = res.get("samples", {})
    results = res.get("results", {})
    atomic_write_json(mdir / "lm_eval_results.json", {k: v for k, v in res.items() if k != "samples"})
    peak_rss = max(r["peak_rss_bytes"] for r in ranks)
    for unit in cfg["units"]:
        recs = [journal[k] for leaf in unit["leaves"] for k in sorted(keys.get(leaf, ())) if k in journal]
        gen_recs = [r for r in recs if r.get("kind") == "generate"]
        by_doc = {(r["task"], r["doc_id"]): r for r in gen_recs}
        rows = _sample_rows(samples, by_doc, unit)
        atomic_write_jsonl(mdir / "samples" / f"{unit['name']}.jsonl", rows)
        metrics = _unit_metrics(cfg, spec, unit, recs, gen_recs, _unit_quality(results, unit), ranks, peak_rss)
        metrics["sandbox_withheld"] = withheld_verdicts(rows)
        atomic_write_json(run_dir / "metrics" / f"{spec['name']}__{unit['name']}.json", metrics)
    atomic_write_json(mdir / "done.json", {
        "computed": sum(r["computed"] for r in ranks), "served_from_journal": sum(r["served"] for r in ranks),
        "warmup_s": [r["warmup_s"] for r in ranks], "warmup_compile": [r.get("warmup_compile") for r in ranks],
        "peak_rss_bytes": peak_rss, "pid": os.getpid()})


def _unit_metrics(cfg: dict, spec: dict, unit: dict, recs: list[dict], gen_recs: list[dict], quality: dict,
                  ranks: list[dict], peak_rss: int) -> dict:
    """The metrics file of one (model, unit): settings, quality, speed, memory, request counts."""
    speed = aggregate(gen_recs)
    failed = sorted(({"task": r["task"], "doc_id": r["doc_id"], "reason": r["failed"]} for r in gen_recs
                     if r.get("failed")), key=lambda f: (f["task"], str(f["doc_id"])))
    knob_sets = sorted({tuple(sorted(r["knobs"].items())) for r in gen_recs}, key=str)
    return {
        "model": spec["name"], "task": unit["name"], "leaves": unit["leaves"], "decoder": spec["decoder"],
        "checkpoint": spec["checkpoint"], "knobs": [dict(k) for k in knob_sets], "model_knobs": spec["knobs"],
        "quality": quality, "quality_primary": unit.get("primary") if unit.get("primary") in quality
        else next(iter(quality), None),
        "speed": {k: speed[k] for k in ("samples", "generated_tokens", "latency_s", "tokens_per_s", "nfe", "tpf",
                                        "nfe_by_phase", "outside_forward_share", "compile")},
        "memory": {**speed["memory"], "peak_rss_bytes": peak_rss,
                   "peak_rss_by_rank": [r["peak_rss_bytes"] for r in ranks],
                   "rss_scope": "whole worker process of this model (all tasks of the run)"},
        "requests": {"total": len(recs), "generate": len(gen_recs)},
        # Items that failed alone (out of memory, non-finite logits, ...): scored as wrong, left out of speed.
        "failed": {"count": len(failed), "items": failed},
        "run": {"run_id": cfg.get("run_id"), "seed": cfg["seed"], "limit": cfg["limit"],
                "chat_template": cfg["chat_template"], "num_processes": cfg["num_processes"],
                "threads": cfg["threads"], "device": cfg["device"], "batch_size": cfg["batch_size"],
                "dtype": cfg.get("dtype", "float32"), "chat_template_args": spec.get("chat_template_args", cfg.get("chat_template_args", {})),
                "environment": cfg.get("environment")},
        "knobs_used": spec.get("resolved_knobs", {}).get(unit["leaves"][0]) if unit["leaves"] else None,
        **({"engine": spec["engine"]} if spec.get("engine") else {}),  # ar@vllm: the engine, its knobs, versions
    }


if __name__ == "__main__":
    raise SystemExit(main())
