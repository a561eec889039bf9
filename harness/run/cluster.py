"""A run spread over a cluster with existing engines, no scheduler of our own (docs/design.md, Runs on a
cluster): ``--shard I/N`` gives each of N independent jobs (a Slurm array) a deterministic, disjoint
share of every task's documents; the token budget of a run and its GPU-hours at a given rate size the
array before it is submitted; multi-node data parallelism is ``accelerate launch``'s, its options passed
through. ``harness merge`` (harness/run/merge.py) joins the shards' folders into one run.

Everything here raises ValueError with a one-line message; the runner turns it into its ``error:`` line.
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.run.store import read_json


def parse_shard(text: str | None) -> dict | None:
    """``I/N`` (1 <= I <= N) -> {"index": I, "count": N}; None for no sharding."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 3/8")
    return {"index": int(m.group(1)), "count": int(m.group(2))}


def shard_docs(n: int, shard: dict | None) -> list[int]:
    """The document indices (of the ``n`` a leaf task runs after LIMIT) that belong to ``shard``: every
    N-th from I-1, so the shards are disjoint, together cover every document, and each gets a share of
    the long and the short ones alike (documents of a benchmark tend to be sorted by source)."""
    if shard is None:
        return list(range(n))
    return list(range(shard["index"] - 1, n, shard["count"]))


def apply_shard(units: list[dict], shard: dict | None) -> list[dict]:
    """The units with ``samples`` counting this shard's documents; ValueError when a leaf task has none
    (lm-eval reads an empty selection as "every document")."""
    if shard is None:
        return units
    out = []
    for u in units:
        docs = u.get("docs") or {}
        empty = [leaf for leaf, n in docs.items() if not shard_docs(n, shard)]
        if empty:
            raise ValueError(f"--shard {shard['index']}/{shard['count']}: task {empty[0]!r} has only "
                             f"{docs[empty[0]]} document(s) (after LIMIT), none for this shard; use at most "
                             f"{min(docs.values())} shards")
        out.append({**u, "samples": sum(len(shard_docs(n, shard)) for n in docs.values())})
    return out


def gen_budget(model: dict, unit: dict) -> int | None:
    """Tokens one request of ``unit`` may generate for ``model``: its resolved ``gen_length``, else (the
    request's own budget) the task's ``max_gen_toks``; None when neither is known."""
    values = (model.get("resolved_knobs") or {}).get(unit["leaves"][0]) if unit.get("leaves") else None
    g = (values or {}).get("gen_length")
    if isinstance(g, int):
        return g
    return unit.get("max_gen_toks")


def budget(cfg: dict) -> list[dict]:
    """Per (model, unit): requests (this shard's documents) and the generated-token budget they may use."""
    rows = []
    for m in cfg["models"]:
        for u in cfg["units"]:
            per = gen_budget(m, u)
            n = u.get("samples") or 0
            rows.append({"model": m["name"], "unit": u["name"], "requests": n, "per_request": per,
                         "tokens": None if per is None else n * per})
    return rows


def parse_rate(text: str | None, cfg: dict) -> dict[str, float]:
    """``--rate``: budget tokens per second per device, one number for every model, or the folder of an
    earlier run: each model's own pace there (its budget tokens / its decode seconds), by model name."""
    if text is None:
        return {}
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None:
        if value <= 0:
            raise ValueError(f"--rate {text!r}: must be > 0 (budget tokens per second per device)")
        return {m["name"]: value for m in cfg["models"]}
    run = Path(text)
    if not (run / "run.json").is_file():
        raise ValueError(f"--rate {text!r}: neither a number nor a run folder (no run.json there)")
    return paces(run)


def rate_remark(text: str | None, cfg: dict) -> str | None:
    """One line when ``--rate <run>`` measured its paces on another device or in another dtype than this run
    will use (a CPU float32 trial for a bfloat16 GPU plan): its device-hours are then a rough guide only."""
    run = Path(text) if text else None
    if run is None or not (run / "run.json").is_file():
        return None
    old = read_json(run / "run.json")
    env = old.get("environment") or {}
    theirs = (str(old.get("device") or env.get("device") or "?").split(":")[0], str(old.get("dtype") or "float32"))
    ours = (str(cfg.get("device") or "?").split(":")[0], str(cfg.get("dtype") or "float32"))
    if theirs == ours:
        return None
    return (f"--rate {text}: its paces were measured on {theirs[0]} in {theirs[1]}, this run decodes on {ours[0]} in "
            f"{ours[1]}: the device-hours below are a rough guide, not a measurement of this setting")


def estimated(rates: dict[str, float], cfg: dict) -> dict[str, float]:
    """A pace for each model that has none of its own: the mean of the others' (None when no model has one)."""
    known = [rates[m["name"]] for m in cfg["models"] if rates.get(m["name"])]
    if not known:
        return {}
    mean = sum(known) / len(known)
    return {m["name"]: mean for m in cfg["models"] if not rates.get(m["name"])}


def paces(run: Path) -> dict[str, float]:
    """Each model's measured pace in an earlier (finished or partial) run: budget tokens / decode seconds."""
    cfg = read_json(run / "run.json")
    out = {}
    for m in cfg.get("models", []):
        tokens = seconds = 0.0
        for u in cfg.get("units", []):
            p = run / "metrics" / f"{m['name']}__{u['name']}.json"
            per = gen_budget(m, u)
            if not p.is_file() or per is None:
                continue
            speed = read_json(p).get("speed") or {}
            tokens += (speed.get("samples") or 0) * per
            seconds += (speed.get("latency_s") or {}).get("total") or 0.0
        if tokens and seconds:
            out[m["name"]] = tokens / seconds
    return out


def describe_budget(cfg: dict, rates: dict[str, float], remark: str | None = None) -> str:
    """The dry run's sizing lines: requests and token budget per (model, task), totals, and GPU-hours
    (device-hours on the CPU) given the rates; a model without a rate of its own is estimated at the others'
    mean pace and marked so, never left out. For one shard, the total of all N shards follows."""
    shard = cfg.get("shard")
    lines = ["budget" + (f" of shard {shard['index']}/{shard['count']}" if shard else "")
             + " (requests x generated-token budget per request):"]
    guessed = estimated(rates, cfg)
    total_tokens, total_hours, all_tokens, all_hours = 0, 0.0, 0, 0.0
    for m in cfg["models"]:
        rows = [b for b in budget(cfg) if b["model"] == m["name"]]
        tokens = sum(b["tokens"] or 0 for b in rows)
        # every document of every task (what all shards together run): the per-leaf counts after LIMIT
        everything = sum((gen_budget(m, u) or 0) * sum((u.get("docs") or {}).values() or [u.get("samples") or 0])
                         for u in cfg["units"])
        total_tokens += tokens
        all_tokens += everything
        parts = ", ".join(f"{b['unit']} {b['requests']} x {b['per_request'] or '?'}" for b in rows)
        rate = rates.get(m["name"]) or guessed.get(m["name"])
        hours = tokens / rate / 3600 if rate else None
        if rate:
            total_hours += hours
            all_hours += everything / rate / 3600
        mark = " (estimated: no pace of its own, the others' mean)" if m["name"] in guessed else ""
        lines.append(f"  {m['name']}: {parts} = {tokens} tokens"
                     + (f", {hours:.3g} device-hours at {rate:.3g} tokens/s{mark}" if hours is not None else ""))
    est = f" (estimated for {', '.join(guessed)})" if guessed else ""
    tail = f"  total: {total_tokens} tokens"
    if rates:
        tail += f", {total_hours:.3g} device-hours{est}"
    else:
        tail += "; give --rate TOKENS_PER_S or --rate <earlier run> for device-hours"
    lines.append(tail)
    if shard:
        lines.append(f"  all {shard['count']} shards: {all_tokens} tokens"
                     + (f", {all_hours:.3g} device-hours{est}" if rates else ""))
    if remark:
        lines.append(f"  note: {remark}")
    return "\n".join(lines)


LAUNCH_OPTIONS = ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "accelerate_config")


def launch_args(launch: dict, num_processes: int, port: int) -> list[str]:
    """``accelerate launch`` options of one model's worker: accelerate's config file when given (its
    machines, ranks and addresses), else the machines given on our command line (one by default)."""
    if launch.get("accelerate_config"):
        return ["--config_file", str(launch["accelerate_config"])]
    machines = int(launch.get("num_machines") or 1)
    args = ["--multi_gpu", "--num_processes", str(num_processes), "--num_machines", str(machines),
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(launch.get("main_process_port") or port)]
    if machines > 1:
        args += ["--machine_rank", str(launch.get("machine_rank") or 0),
                 "--main_process_ip", str(launch.get("main_process_ip") or "127.0.0.1")]
    return args


def machine_rank(launch: dict) -> int:
    """This machine's rank: ``--machine-rank``, else the ``machine_rank`` of accelerate's config file, else 0."""
    if launch.get("machine_rank") is not None:
        return int(launch["machine_rank"])
    if launch.get("accelerate_config"):
        import yaml

        try:
            data = yaml.safe_load(Path(launch["accelerate_config"]).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--accelerate-config {launch['accelerate_config']!r}: cannot be read ({e})") from None
        return int(data.get("machine_rank") or 0) if isinstance(data, dict) else 0
    return 0


def check_launch(launch: dict, num_processes: int) -> None:
    """ValueError for multi-node options that cannot work together."""
    machines = int(launch.get("num_machines") or 1)
    rank = int(launch.get("machine_rank") or 0)
    if machines < 1 or not 0 <= rank < machines:
        raise ValueError(f"--machine-rank {rank} with --num-machines {machines}: need 0 <= rank < machines")
    if machines > 1 and num_processes % machines:
        raise ValueError(f"--num-processes {num_processes} (all machines together) is not a multiple of "
                         f"--num-machines {machines}")
    if machines > 1 and not launch.get("main_process_ip"):
        raise ValueError("--num-machines > 1 needs --main-process-ip (the address of machine rank 0)")
    cfg = launch.get("accelerate_config")
    if cfg and not Path(cfg).is_file():
        raise ValueError(f"--accelerate-config {str(cfg)!r}: no such file")
