"""Our ReFusion decoder against the authors' `generate_refusion`, timed side by side on the same
checkpoint, prompts and tokens (issue 32, item 3).

    python scripts/side_by_side_authors.py --theirs-python /tmp/authors-venv-q3/bin/python \\
        --refusion-repo /tmp/refusion-upstream [--short 10] [--long 8] [--reps 7] [--threads 2] \\
        [--ours eager,compiled] [--out results/side_by_side_authors.json]

The two sides need different transformers (ours 5.x, the authors' qwen3 file 4.52.x), so they never
share an interpreter. The driver (this file, in the project's python) starts two persistent worker
processes, each running this same file with ``--worker``: ``ours`` in ``--ours-python`` (default: the
driver's) with the working tree first on PYTHONPATH, ``theirs`` in ``--theirs-python`` importing
``generate.py`` of the ``--refusion-repo`` checkout (ML-GSAI/ReFusion, never copied here). Each loads the
checkpoint once (float32, CPU, ``--threads`` torch threads), then answers one JSON request per line on
stdin with one JSON line on stdout; the driver sends one request at a time, so only one side runs at any
moment.

Prompt sets, batch 1:
  short  the embedded suite's test items (``--short`` per kind of math / code / choice), chat-templated
         as `harness eval` sends them, each with the knobs a run uses (the `refusion` preset over the
         task table's gen_length), decoded without EOS by default (``--short-eos``, below);
  long   ``harness.speed.bench.long_prompts`` (~700 tokens) with bench.py's LONG_KNOBS and no EOS.
Knob mapping (ours -> their arguments): gen_length, slot_size, serial_num_blocks, slot_threshold and
token_threshold by the same name, temperature 0, mask_id = the checkpoint's mask token; their EOS is
read from ``tokenizer.eos_token_id``, so their tokenizer argument is a stand-in that carries the EOS
of the set (-1 = none, as bench.py passes to ours for the long case).

EOS: when an EOS is accepted during parallel infill, the reference drops the picked slots after it by
their index among the picked slots rather than by position, which can leave slots before the EOS
unfilled and changes the later plans; our decoder does not reproduce that (the module doc of
refusion/decoding/refusion.py). With the checkpoint's EOS the tiny model's math answers hit it, so the
timed short set decodes without EOS
(both sides run the full gen_length and give the same tokens) and an untimed check with the
checkpoint's EOS is recorded beside it; ``--short-eos model`` times with the EOS instead.

Timing: perf_counter around the decoder call inside each worker. Per prompt set, one untimed warm-up
call per side (the set's first prompt), then ``--reps`` repetitions; a repetition decodes every prompt
in ABBA order (ours variants, theirs, theirs, ours variants reversed), so drift hits both alike.
Tokens are counted alike for both sides (response tokens up to and including the first EOS, as
docs/design.md §6); tokens/s = sum of tokens / sum of seconds per (side, set, repetition); the figure
is the median over repetitions of ours / theirs. Tokens are compared per prompt (both cut after the
first EOS) and every mismatch is printed and kept in the JSON. A `compiled` variant adds the decoder's
``compile=True`` knob, recorded as not available when the decoder has no such knob.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from array import array
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_REPO = "ML-GSAI/ReFusion"
UPSTREAM_COMMIT = "7c20c120b8e558ebee3cb5e72a1393d9ef4a3a2b"
# git blob ids of the upstream files the authors' side runs, at UPSTREAM_COMMIT (`git ls-tree`).
UPSTREAM_BLOBS = {
    "generate.py": "7cb5fefc066f7230ce2891418d47354b7182e960",
    "qwen3/modeling_qwen3_refusion.py": "c07f409437cef7a46ba8b91d91a1a0aedaba10a1",
    "qwen3/diffusion_cache_utils.py": "0b2e437b84e5aef7688df98842a877512ad4897d",
    "qwen3/configuration_qwen3.py": "8e15a988b523ebec6a34ac81152ff79c88beb45b",
}
CHECKPOINT = "checkpoints/tiny/refusion"
VARIANTS = ("eager", "compiled")
SETS = ("short", "long")
# ours / theirs tokens/s targets of issue 32 item 3, per (our path, prompt set).
TARGETS = {("eager", "short"): 1.2, ("eager", "long"): 2.0, ("compiled", "short"): 2.0, ("compiled", "long"): 3.0}
# Our knob -> their generate_refusion argument (same meaning; checked by tokens on every prompt).
KNOB_TO_THEIRS = {"gen_length": "gen_length", "slot_size": "slot_size", "serial_num_blocks": "serial_num_blocks",
                  "slot_threshold": "slot_threshold", "token_threshold": "token_threshold",
                  "temperature": "temperature"}
NO_COMPILE = "not available (no compile knob)"


# ---------------------------------------------------------------- pure helpers (tested)

def cut_at_eos(tokens: list[int], eos: int) -> list[int]:
    """Response tokens up to and including the first EOS (all of them when there is none)."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else list(tokens)


def count_tokens(tokens: list[int], eos: int) -> int:
    """Generated tokens as docs/design.md §6 counts them, the same for both sides."""
    return len(cut_at_eos(tokens, eos))


def abba(sides: list[str]) -> list[str]:
    """One repetition's call order for one prompt: the sides, then the same reversed (A B B A)."""
    return list(sides) + list(reversed(sides))


def side_names(variants: list[str]) -> list[str]:
    """Worker sides in call order: our variants, then theirs."""
    return [f"ours_{v}" for v in variants] + ["theirs"]


def theirs_kwargs(knobs: dict, mask_id: int) -> dict:
    """Keyword arguments of the authors' generate_refusion for our knobs (greedy); ValueError for a knob
    of ours it has no argument for (their EOS comes from the tokenizer stand-in, not from here)."""
    extra = set(knobs) - set(KNOB_TO_THEIRS)
    if extra:
        raise ValueError(f"no counterpart in generate_refusion for knob(s) {', '.join(sorted(extra))}")
    out = {KNOB_TO_THEIRS[k]: v for k, v in knobs.items()}
    out.setdefault("temperature", 0.0)
    if out["temperature"] != 0:
        raise ValueError("the side-by-side compares greedy decoding only (temperature 0)")
    out["mask_id"] = mask_id
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tps(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def median_ratio(ours: list[float | None], theirs: list[float | None]) -> float | None:
    """Median over repetitions of ours / theirs tokens/s (repetitions missing a figure are skipped)."""
    r = [o / t for o, t in zip(ours, theirs) if o is not None and t]
    return statistics.median(r) if r else None


def table(ratios: dict[str, dict[str, float | None]], same: dict[str, dict[str, bool | None]],
          notes: dict[str, str] | None = None) -> dict:
    """The four cells of issue 32's table: {variant: {set: {value, target, met, same_tokens[, note]}}}.
    ``ratios[variant][set]`` is the median ratio (None: not measured), ``same[variant][set]`` whether every
    prompt gave the same tokens; ``notes[variant]`` says why a variant was not measured. A cell is met only
    with the same tokens on every prompt."""
    out: dict = {}
    for variant in VARIANTS:
        out[variant] = {}
        for s in SETS:
            target = TARGETS[(variant, s)]
            value = ratios.get(variant, {}).get(s)
            st = same.get(variant, {}).get(s)
            cell = {"value": round(value, 4) if value is not None else None, "target": f">= {target}",
                    "met": None if value is None else bool(value >= target and st is True), "same_tokens": st}
            if value is None:
                cell["note"] = (notes or {}).get(variant) or "not measured"
            out[variant][s] = cell
    return out


def git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def upstream_files(repo: Path) -> dict:
    """Blob ids of the authors' files in the checkout against UPSTREAM_COMMIT's."""
    got = {name: git_blob_id(repo / name) if (repo / name).is_file() else None for name in UPSTREAM_BLOBS}
    head = None
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"repo": UPSTREAM_REPO, "pinned_commit": UPSTREAM_COMMIT, "checkout": str(repo), "checkout_head": head,
            "file_blobs": got, "files_match_pinned_commit": got == UPSTREAM_BLOBS}


# ---------------------------------------------------------------- workers

def _protocol_stdout():
    """The real stdout for the JSON lines; anything else printed goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _floats_b64(t) -> str:
    return base64.b64encode(t.detach().float().contiguous().numpy().tobytes()).decode()


class _EosTokenizer:
    """What the authors' generate_refusion reads from its tokenizer argument: eos_token_id."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id = eos


def worker(side: str, checkpoint: str, threads: int, refusion_repo: str | None) -> int:
    import torch

    torch.set_num_threads(threads)
    out = _protocol_stdout()
    path = str(Path(checkpoint).resolve())
    env = {"python": sys.version.split()[0], "executable": sys.executable, "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads()}
    if side == "ours":
        import transformers
        from transformers import AutoModelForCausalLM

        import refusion
        from refusion.decoding import get_decoder

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        decoder = get_decoder("refusion")
        names = decoder.knobs.names()
        env.update(transformers=transformers.__version__, refusion_package=str(Path(refusion.__file__).parent),
                   knobs=names, model_class=type(model).__name__)

        def decode(req):
            knobs = dict(req["knobs"], **({"compile": True} if req.get("variant") == "compiled" else {}))
            ids = torch.tensor([req["ids"]])
            c0, t0 = time.process_time(), time.perf_counter()
            toks, _ = decoder(model, ids, None, knobs, eos_token_id=req["eos"], mask_token_id=req["mask"])
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            return toks[0].tolist(), secs, cpu

        def logits(ids):
            with torch.no_grad():
                return model(torch.tensor([ids])).logits[0]
    else:
        import importlib.util

        import transformers

        sys.path.insert(0, str(Path(refusion_repo).resolve()))
        spec = importlib.util.spec_from_file_location("refusion_authors_generate",
                                                      str(Path(refusion_repo).resolve() / "generate.py"))
        gen = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = gen
        spec.loader.exec_module(gen)
        model = gen.Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        env.update(transformers=transformers.__version__, generate_py=str(Path(gen.__file__).resolve()),
                   model_class=f"{type(model).__module__}.{type(model).__name__}")

        def decode(req):
            ids = torch.tensor([req["ids"]])
            c0, t0 = time.process_time(), time.perf_counter()
            x, _tpf = gen.generate_refusion(model, _EosTokenizer(req["eos"]), ids, **req["kwargs"])
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
            return x[0, ids.shape[1]:].tolist(), secs, cpu

        def logits(ids):
            with torch.no_grad():
                return model(input_ids=torch.tensor([ids])).logits[0]

    out.write(json.dumps({"ready": True, "env": env}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            if req["op"] == "quit":
                break
            if req["op"] == "decode":
                toks, secs, cpu = decode(req)
                reply = {"tokens": toks, "seconds": secs, "cpu_seconds": cpu}
            elif req["op"] == "logits":
                lg = logits(req["ids"])
                reply = {"shape": list(lg.shape), "logits_b64": _floats_b64(lg)}
            else:
                reply = {"error": f"unknown op {req['op']!r}"}
        except Exception:  # noqa: BLE001 - the driver prints it and stops
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
    return 0


class Worker:
    """A persistent worker process: one JSON request, one JSON reply."""

    def __init__(self, name: str, cmd: list[str], env: dict, cwd: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd,
                                     text=True, bufsize=1)
        self.env = self._read()["env"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"the {self.name} worker exited (rc {rc}); its messages are above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the {self.name} worker failed:\n{reply['error']}")
        return reply

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------- prompts and knobs

def short_prompts(tok, per_kind: int) -> list[dict]:
    """The embedded suite's first ``per_kind`` test items per kind, as `harness eval` sends them, with the
    knobs a run of the `refusion` preset uses on that task (runner precedence: task table, then preset)."""
    from harness.run.presets import PRESETS
    from refusion.decoding import get_decoder
    from tasks.embedded import KINDS, load_split
    from tasks.info import TASKS

    accepted = set(get_decoder("refusion").knobs.names())
    preset = PRESETS["refusion"]
    out = []
    for kind in KINDS:
        knobs = {**TASKS[f"embedded_{kind}"].decoding_knobs("refusion", accepted), **preset.knobs}
        for i, item in enumerate(load_split(kind, "test")[:per_kind]):
            text = tok.apply_chat_template([{"role": "user", "content": item["query"]}], tokenize=False,
                                           add_generation_prompt=True)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            out.append({"kind": kind, "index": i, "ids": ids, "knobs": knobs})
    return out


def long_prompt_set(tok, n: int) -> list[dict]:
    from harness.speed.bench import LONG_KNOBS, long_prompts

    return [{"kind": "code_long", "index": i, "ids": ids, "knobs": dict(LONG_KNOBS)}
            for i, ids in enumerate(long_prompts(tok, n))]


def checkpoint_ids(folder: Path, tok) -> tuple[int, int]:
    """(EOS, mask id) of the checkpoint. Their loop takes one EOS id (the tokenizer's); ours gets the same
    one, after checking that the configs name no other."""
    cfg = json.loads((folder / "config.json").read_text())
    gen = folder / "generation_config.json"
    ids = {tok.eos_token_id, cfg.get("eos_token_id")}
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(e) if isinstance(e, list) else {e}
    ids.discard(None)
    if len(ids) != 1:
        raise ValueError(f"{folder}: EOS ids {sorted(ids)}; the authors' loop takes one (tokenizer.eos_token_id)")
    return ids.pop(), int(cfg["mask_token_id"])


# ---------------------------------------------------------------- measuring

def decode(workers: dict[str, Worker], side: str, p: dict, eos: int, mask: int) -> dict:
    """One decoder call of ``side`` (ours_<variant> or theirs) on prompt ``p``: its tokens and seconds."""
    if side == "theirs":
        return workers["theirs"].ask(op="decode", ids=p["ids"], eos=eos, kwargs=theirs_kwargs(p["knobs"], mask))
    return workers["ours"].ask(op="decode", ids=p["ids"], eos=eos, mask=mask, knobs=p["knobs"],
                               variant=side.removeprefix("ours_"))


def measure_set(name: str, prompts: list[dict], eos: int, mask: int, workers: dict[str, Worker], sides: list[str],
                reps: int, log) -> dict:
    """Warm-up, then ``reps`` ABBA repetitions over the prompts; raw figures, token checks, ratios."""
    def call(side: str, p: dict) -> dict:
        return decode(workers, side, p, eos, mask)

    for side in sides:  # one untimed warm-up per side
        call(side, prompts[0])
    first: dict[str, list] = {s: [None] * len(prompts) for s in sides}
    unstable: list[dict] = []
    per_rep = []
    for r in range(reps):
        acc = {s: {"tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0} for s in sides}
        for j, p in enumerate(prompts):
            for side in abba(sides):
                reply = call(side, p)
                toks = cut_at_eos(reply["tokens"], eos)
                acc[side]["tokens"] += len(toks)
                acc[side]["seconds"] += reply["seconds"]
                acc[side]["cpu_seconds"] += reply["cpu_seconds"]
                if first[side][j] is None:
                    first[side][j] = {"raw": reply["tokens"], "cut": toks}
                elif first[side][j]["cut"] != toks:
                    unstable.append({"side": side, "prompt": j, "repetition": r})
        per_rep.append(acc)
        log(f"{name:<6} repetition {r + 1}/{reps}: " + "  ".join(
            f"{s} {acc[s]['tokens'] / acc[s]['seconds']:.1f} tok/s" for s in sides))
    rows, mismatches = [], []
    same: dict[str, bool] = {}
    theirs = first["theirs"]
    for j, p in enumerate(prompts):
        row = {"kind": p["kind"], "index": p["index"], "prompt_tokens": len(p["ids"]), "knobs": p["knobs"],
               "tokens": {s: len(first[s][j]["cut"]) for s in sides},
               "theirs_raw_tokens": len(theirs[j]["raw"])}
        for s in sides[:-1]:
            variant = s.removeprefix("ours_")
            diff = first_difference(first[s][j]["cut"], theirs[j]["cut"])
            row[f"same_tokens_{variant}"] = diff is None
            same[variant] = same.get(variant, True) and diff is None
            if diff is not None:
                mismatches.append({"set": name, "prompt": j, "kind": p["kind"], "index": p["index"],
                                   "variant": variant, "first_difference": diff,
                                   "ours": first[s][j]["cut"], "theirs": theirs[j]["cut"]})
        rows.append(row)
    figures = {}
    for s in sides:
        t = [a[s]["tokens"] for a in per_rep]
        sec = [a[s]["seconds"] for a in per_rep]
        rates = [tps(a, b) for a, b in zip(t, sec)]
        figures[s] = {"tokens_per_rep": t, "seconds_per_rep": [round(x, 6) for x in sec],
                      # process CPU seconds (all threads) over wall seconds: ~threads on an idle machine
                      "cpu_over_wall_per_rep": [round(a[s]["cpu_seconds"] / a[s]["seconds"], 3) for a in per_rep],
                      "tps_per_rep": [round(x, 3) if x is not None else None for x in rates],
                      "tps_median": round(statistics.median(x for x in rates if x is not None), 3),
                      "tps_all_reps": round(tps(sum(t), sum(sec)), 3)}
    ratios = {}
    for s in sides[:-1]:
        rs = [a / b for a, b in zip(figures[s]["tps_per_rep"], figures["theirs"]["tps_per_rep"]) if a and b]
        med = median_ratio(figures[s]["tps_per_rep"], figures["theirs"]["tps_per_rep"])
        ratios[s.removeprefix("ours_")] = {
            "per_rep": [round(x, 4) for x in rs], "median": round(med, 4) if med is not None else None,
            "all_reps": round(figures[s]["tps_all_reps"] / figures["theirs"]["tps_all_reps"], 4)}
    return {"prompts": len(prompts), "prompt_tokens_mean": round(statistics.mean(len(p["ids"]) for p in prompts), 1),
            "eos": eos, "calls_per_side_per_rep": 2 * len(prompts), "per_prompt": rows, "sides": figures,
            "ratios": ratios, "same_tokens": same, "mismatches": mismatches, "nondeterministic": unstable}


def eos_check(prompts: list[dict], eos: int, mask: int, workers: dict[str, Worker], side: str) -> dict:
    """Untimed: both sides once per prompt with the checkpoint's EOS, tokens compared (cut after the EOS).
    Where they differ, theirs is the shorter answer: when an EOS is accepted during parallel infill, the
    reference drops the picked slots after it by their index among the picked slots, not by position,
    so slots before the EOS can stay unfilled (refusion/decoding/refusion.py, "EOS during parallel infill")."""
    differ = []
    for j, p in enumerate(prompts):
        o = cut_at_eos(decode(workers, side, p, eos, mask)["tokens"], eos)
        t = cut_at_eos(decode(workers, "theirs", p, eos, mask)["tokens"], eos)
        d = first_difference(o, t)
        if d is not None:
            differ.append({"prompt": j, "kind": p["kind"], "index": p["index"], "first_difference": d,
                           "ours_tokens": len(o), "theirs_tokens": len(t), "ours": o, "theirs": t})
    return {"eos": eos, "side": side, "prompts": len(prompts), "same": len(prompts) - len(differ), "differ": differ}


def logits_check(prompt: list[int], workers: dict[str, Worker]) -> dict:
    a, b = (workers[w].ask(op="logits", ids=prompt) for w in ("ours", "theirs"))
    fa, fb = array("f"), array("f")
    fa.frombytes(base64.b64decode(a["logits_b64"]))
    fb.frombytes(base64.b64decode(b["logits_b64"]))
    if a["shape"] != b["shape"]:
        return {"prompt_tokens": len(prompt), "shapes": [a["shape"], b["shape"]], "max_abs_diff": None}
    return {"prompt_tokens": len(prompt), "shape": a["shape"], "max_abs_diff": max(abs(x - y) for x, y in zip(fa, fb))}


# ---------------------------------------------------------------- environment

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def project_commit() -> dict:
    def git(*a):
        r = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


# ---------------------------------------------------------------- driver

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python scripts/side_by_side_authors.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog="Setup of the authors' side (a scratch venv, never the project's .venv):\n"
               "  python3 -m venv /tmp/authors-venv-q3 && /tmp/authors-venv-q3/bin/pip install torch==2.13.0 && \\\n"
               "  /tmp/authors-venv-q3/bin/pip install transformers==4.52.4 pandas tqdm safetensors numpy\n"
               f"  git clone https://github.com/{UPSTREAM_REPO} R && git -C R checkout {UPSTREAM_COMMIT[:12]}\n"
               f"  (or from a mirror: mkdir R && git -C MIRROR archive {UPSTREAM_COMMIT[:12]} | tar -x -C R)\n"
               "The JSON holds ours/theirs tokens/s per (our path, prompt set) against the issue's targets, the raw\n"
               "figures per side and repetition, the token check per prompt and both environments.")
    p.add_argument("--theirs-python", help="python of the authors' side (transformers 4.52.x, torch); required")
    p.add_argument("--refusion-repo", help=f"checkout of {UPSTREAM_REPO} (its generate.py and qwen3/); required")
    p.add_argument("--ours-python", default=sys.executable, help="python of our side (default: this one)")
    p.add_argument("--ours", default="eager,compiled",
                   help="our variants, comma-separated: eager (the set's knobs), compiled (plus compile=True); "
                        "default %(default)s")
    p.add_argument("--checkpoint", default=CHECKPOINT,
                   help="ReFusion checkpoint folder (qwen3 layout); default %(default)s")
    p.add_argument("--short", type=int, default=10,
                   help="embedded test items per kind (math, code, choice); 0 = skip; default %(default)s")
    p.add_argument("--short-eos", choices=["none", "model"], default="none",
                   help="EOS of the timed short set: none (default: both decode gen_length; same tokens) or model "
                        "(the checkpoint's EOS: the reference's EOS handling gives other tokens on some prompts); "
                        "with none, an untimed check with the checkpoint's EOS is recorded too")
    p.add_argument("--long", type=int, default=8,
                   help="~700-token prompts (bench.py's long case); 0 = skip; default %(default)s")
    p.add_argument("--reps", type=int, default=7,
                   help="timed repetitions (each one ABBA over every prompt); default %(default)s")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each worker; default %(default)s")
    p.add_argument("--out", default=str(REPO / "results" / "side_by_side_authors.json"),
                   help="the JSON (written atomically); default results/side_by_side_authors.json")
    p.add_argument("--worker", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    return p


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        return worker(a.worker, a.checkpoint, a.threads, a.refusion_repo)
    if not a.theirs_python:
        return _error("--theirs-python is required: a python with torch and transformers 4.52.x "
                      "(see --help for the scratch venv)")
    if not (Path(a.theirs_python).is_file() and os.access(a.theirs_python, os.X_OK)):
        return _error(f"--theirs-python {a.theirs_python}: not an executable file")
    if not a.refusion_repo:
        return _error(f"--refusion-repo is required: a checkout of {UPSTREAM_REPO} at {UPSTREAM_COMMIT[:12]}")
    repo = Path(a.refusion_repo)
    if not (repo / "generate.py").is_file() or not (repo / "qwen3").is_dir():
        return _error(f"--refusion-repo {repo}: no generate.py and qwen3/ there (a checkout of {UPSTREAM_REPO})")
    variants = [v.strip() for v in a.ours.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
        return _error(f"--ours {a.ours!r}: a comma list of {', '.join(VARIANTS)}")
    if a.short < 0 or a.long < 0 or a.short + a.long == 0 or a.reps < 1 or a.threads < 1:
        return _error("--short and --long must be >= 0 (not both 0), --reps and --threads >= 1")
    ckpt = Path(a.checkpoint)
    ckpt = ckpt if ckpt.is_absolute() else (REPO / ckpt if (REPO / ckpt).is_dir() else ckpt.resolve())
    if not (ckpt / "config.json").is_file():
        return _error(f"--checkpoint {a.checkpoint}: no config.json there")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from harness.run.store import atomic_write_json

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    eos, mask = checkpoint_ids(ckpt, tok)
    from harness.speed.bench import NO_EOS

    sets = {}
    if a.short:
        sets["short"] = (short_prompts(tok, a.short), NO_EOS if a.short_eos == "none" else eos)
    if a.long:
        sets["long"] = (long_prompt_set(tok, a.long), NO_EOS)

    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    ours_env = dict(env, PYTHONPATH=os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                    else [])))
    theirs_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    common = ["--checkpoint", str(ckpt), "--threads", str(a.threads)]
    workers: dict[str, Worker] = {}
    t_start = time.time()
    try:
        log("starting the workers (each loads the checkpoint once) ...")
        workers["ours"] = Worker("ours", [a.ours_python, str(Path(__file__).resolve()), "--worker", "ours", *common],
                                 ours_env, str(REPO))
        workers["theirs"] = Worker("theirs", [a.theirs_python, str(Path(__file__).resolve()), "--worker", "theirs",
                                              *common, "--refusion-repo", str(repo.resolve())], theirs_env, "/tmp")
        notes = {}
        if "compile" not in workers["ours"].env["knobs"]:
            if "compiled" in variants:
                variants.remove("compiled")
                notes["compiled"] = NO_COMPILE
                log(f"compiled: {NO_COMPILE}")
        elif "compiled" not in variants:
            notes["compiled"] = "not run (--ours without compiled)"
        if "eager" not in variants:
            notes["eager"] = "not run (--ours without eager)"
        if not variants:
            print(f"error: --ours {a.ours}: nothing of ours to run (compiled: {NO_COMPILE})", file=sys.stderr)
            return 2
        sides = side_names(variants)
        logits = {name: logits_check(prompts[0]["ids"], workers) for name, (prompts, _) in sets.items()}
        eos_checked = None
        if "short" in sets and a.short_eos == "none":
            log(f"short: untimed token check with the checkpoint's EOS ({eos}) ...")
            eos_checked = eos_check(sets["short"][0], eos, mask, workers, sides[0])
        results = {}
        for name, (prompts, set_eos) in sets.items():
            log(f"{name}: {len(prompts)} prompts, sides {', '.join(sides)}, {a.reps} repetition(s) ...")
            results[name] = measure_set(name, prompts, set_eos, mask, workers, sides, a.reps, log)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for w in workers.values():
            w.close()

    ratios = {v: {s: r["ratios"][v]["median"] for s, r in results.items()} for v in variants}
    same = {v: {s: r["same_tokens"][v] for s, r in results.items()} for v in variants}
    cells = table(ratios, same, notes)
    report = {
        "command": "python scripts/side_by_side_authors.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_seconds": round(time.time() - t_start, 1),
        "table": cells,
        "same_tokens": all(all(r["same_tokens"].values()) for r in results.values()),
        "environment": {
            "ours": workers["ours"].env, "theirs": workers["theirs"].env, "threads": a.threads,
            "cpu": cpu_name(), "cpus_visible": os.cpu_count(), "platform": platform.platform(),
            "device": "cpu", "dtype": "float32", "batch_size": 1,
            "project": project_commit(), "upstream": upstream_files(repo.resolve()),
        },
        "settings": {
            "checkpoint": str(ckpt.relative_to(REPO)) if ckpt.is_relative_to(REPO) else str(ckpt),
            "variants": variants, "short_per_kind": a.short, "long_prompts": a.long, "reps": a.reps,
            "order": "per prompt, each repetition: " + " ".join(abba(sides)),
            "warmup": "one untimed call per side per prompt set, on the set's first prompt",
            "timing": "perf_counter around the decoder call inside each worker",
            "tokens": "response tokens up to and including the first EOS (docs/design.md §6), same for both sides",
            "figure": "median over repetitions of ours/theirs, tokens/s = sum tokens / sum seconds per repetition",
            "knob_mapping": {**KNOB_TO_THEIRS, "mask_token_id": "mask_id",
                             "eos_token_id": "tokenizer.eos_token_id (a stand-in tokenizer carrying the set's EOS)"},
            "mask_id": mask, "eos": {s: e for s, (_, e) in sets.items()}, "short_eos": a.short_eos,
            "checkpoint_eos": eos,
        },
        "short_eos_check": eos_checked,
        "logits_check": logits,
        "sets": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out, report)

    for name, r in results.items():
        for s, f in r["sides"].items():
            busy = statistics.median(f["cpu_over_wall_per_rep"])
            print(f"{name:<6} {s:<14} tps={f['tps_median']:9.1f}  (median of {a.reps}; {f['tokens_per_rep'][0]} "
                  f"tokens per repetition, {r['prompts']} prompts x2; cpu/wall {busy:.2f})")
        for m in r["mismatches"]:
            print(f"{name:<6} MISMATCH {m['variant']} prompt {m['prompt']} ({m['kind']} #{m['index']}): first "
                  f"difference at token {m['first_difference']} (ours {len(m['ours'])}, theirs {len(m['theirs'])} "
                  "tokens)")
        if r["nondeterministic"]:
            print(f"{name:<6} NONDETERMINISTIC tokens across calls: {r['nondeterministic']}")
    for variant, row in cells.items():
        for s, c in row.items():
            if c["value"] is None:
                print(f"{s:<6} {variant:<9} ours/theirs  {c['note']}")
            else:
                print(f"{s:<6} {variant:<9} ours/theirs x{c['value']:.3f}  target {c['target']}  "
                      f"{'met' if c['met'] else 'NOT met'}  same tokens: {c['same_tokens']}")
    if eos_checked:
        print(f"short  with EOS {eos} (untimed): {eos_checked['same']}/{eos_checked['prompts']} prompts same tokens")
        for d in eos_checked["differ"]:
            print(f"short  with EOS: DIFFERENT prompt {d['prompt']} ({d['kind']} #{d['index']}) from token "
                  f"{d['first_difference']} (ours {d['ours_tokens']}, theirs {d['theirs_tokens']} tokens)")
    for name, lc in logits.items():
        print(f"{name:<6} logits max |ours - theirs| = {lc['max_abs_diff']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
