"""`make bench-kernels`: op-level time and memory of packed slot attention per backend.

    python -m harness bench-kernels [--device cpu|cuda] [--prefixes 256,1024,4096] [--slots 1,4,8,16]
                                    [--slot-lens 8,32] [--backends ...] [--repeats 5] [--quick]
                                    [--out results/bench_kernels.json] [--plot reports/kernels.png]

Qwen3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, batch 1): a query run of
k slots x L tokens after a prefix of P cached keys, for every (P, k, L). Backends:

  sdpa        the dense [n, P + n] mask through scaled_dot_product_attention (what the decoders
              passed the model before the kernels);
  replicated  the prefix KV copied once per slot into batch rows, one causal SDPA call (the
              authors' layout: k copies of the prefix);
  flex        flex_attention with the slot mask_mod and a layout-built BlockMask, compiled
              (the first call per query bucket compiles; its time is reported apart);
  triton      the Triton kernel (CUDA only).
On CPU: float32, the CPU backends. On CUDA: float32 and bfloat16, triton added, and the
speed targets checked at P = 4096, k = 8 (triton and flex each >= 1.5x faster than
replicated, triton no slower than flex); on the CPU the goal is memory, speed is judged on a GPU.

Timing (harness/run/timing.py's protocol): one warm-up call per backend (`first_call_s`; it
includes the flex compile when it is the first call of its query bucket), then `--repeats` rounds in
which every backend of the shape makes one call, in ABBA order; median and min in ms over rounds,
device-synchronised on CUDA. Memory: `extra_bytes`, what the backend builds beyond q, k, v
and the output by construction (the dense mask, the k prefix copies, the flex block tables and
padded query, the kernel's slot tables); on CUDA also `peak_bytes`, the measured peak of
allocated memory during a call above the inputs. Every output is compared with the sdpa one
(`max_abs_diff_vs_sdpa`). JSON is written atomically; the plot (time and memory against k per
prefix) goes to --plot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B attention
CPU_BACKENDS = ("sdpa", "replicated", "flex")
ALL_BACKENDS = ("sdpa", "replicated", "flex", "triton")
TARGET_PREFIX, TARGET_SLOTS = 4096, 8


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be a comma list of integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals) or (name != "prefixes" and any(v < 1 for v in vals)):
        raise ValueError(f"--{name} must be a comma list of {'integers >= 0' if name == 'prefixes' else 'positive integers'}, "
                         f"got {text!r}")
    return vals


def extra_bytes(backend: str, prefix: int, k: int, length: int, elem: int) -> int:
    """Bytes a backend builds beyond q, k, v and the output, by construction (batch 1)."""
    from refusion.kernels import FLEX_BLOCK, flex_bucket

    n = k * length
    if backend == "sdpa":  # the bool mask here; the decoders' additive float mask is 4x that
        return n * (prefix + n)
    if backend == "replicated":  # per slot a copy of the prefix K and V plus its own (KV heads), and the causal mask
        return k * 2 * KV_HEADS * (prefix + length) * HEAD_DIM * elem + length * (prefix + length)
    if backend == "flex":  # padded query, block tables (2 x [q tiles, kv tiles] int32) and slot id arrays
        q_pad = flex_bucket(n)
        q_tiles, kv_tiles = -(-q_pad // FLEX_BLOCK), -(-(prefix + n) // FLEX_BLOCK)
        return (q_pad - n) * HEADS * HEAD_DIM * elem * (q_pad != n) + 4 * (2 * q_tiles * (kv_tiles + 1)
                                                                        + q_tiles * FLEX_BLOCK
                                                                        + 2 * kv_tiles * FLEX_BLOCK)
    if backend == "triton":  # slot index and slot start per query, int32
        return 2 * 4 * n
    return 0


def bench_shape(backends, dtype, device, prefix: int, k: int, length: int, repeats: int) -> list[dict]:
    """One row per backend for one shape. The backends are timed against each other by the timing protocol
    (harness/run/timing.py): one warm-up call each (``first_call_s``: it includes the flex compile of a new
    query bucket), then ``repeats`` rounds in which every backend makes one call, in ABBA order, so a drift of
    the machine falls on every backend alike; median and min ms over rounds, device-synchronised on CUDA."""
    import torch

    from harness.run import timing
    from refusion.kernels import slot_attention_op

    n = k * length
    g = torch.Generator(device="cpu").manual_seed(prefix * 1000 + k * 10 + length)
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    kk = torch.randn(1, KV_HEADS, prefix + n, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    vv = torch.randn(1, KV_HEADS, prefix + n, HEAD_DIM, generator=g).to(device=device, dtype=dtype)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    rows, calls, outs = {}, {}, {}
    for b in backends:
        def first(b=b):
            return slot_attention_op(q, kk, vv, prefix, [length] * k, backend=b)

        # A timed call: FnSide's (output, tokens); no output to compare between rounds (checked once below).
        calls[b] = lambda first=first: (first(), (None, 0))[1]
        outs[b], first_s, _ = timing.clock(first, sync)  # warm-up: compiles flex / the triton kernel
        rows[b] = {"backend": b, "dtype": str(dtype).removeprefix("torch."), "prefix": prefix, "slots": k,
                   "slot_len": length, "n": n, "first_call_s": first_s, "repeats": repeats,
                   "extra_bytes": extra_bytes(b, prefix, k, length, q.element_size())}
        if cuda:  # the peak above the inputs during one call (the output is counted: every backend allocates one)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            first()
            torch.cuda.synchronize()
            rows[b]["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    sides = [timing.FnSide(b, {"shape": [calls[b]]}, sync=sync) for b in backends]
    got = timing.run_rounds(sides, ["shape"], rounds=repeats, min_block_s=0.0, progress=False)
    ref = outs.get("sdpa")
    for b in backends:
        wall, _, _ = timing.matrix(got["records"], b, "shape")
        times = [float(x) for x in wall[:, 0]]
        rows[b].update(ms_median=1000 * statistics.median(times), ms_min=1000 * min(times), timing="abba rounds")
        if ref is not None and b != "sdpa":
            rows[b]["max_abs_diff_vs_sdpa"] = (outs[b].float() - ref.float()).abs().max().item()
    return [rows[b] for b in backends]


def targets(rows: list[dict]) -> list[dict]:
    """The GPU speed targets at P = 4096, k = 8, per dtype and slot length (when the rows are there)."""
    out = []
    by = {(r["dtype"], r["prefix"], r["slots"], r["slot_len"], r["backend"]): r["ms_median"] for r in rows}
    for dtype, length in sorted({(r["dtype"], r["slot_len"]) for r in rows}):
        key = (dtype, TARGET_PREFIX, TARGET_SLOTS, length)
        rep, fl, tr = by.get((*key, "replicated")), by.get((*key, "flex")), by.get((*key, "triton"))
        if rep is None or fl is None or tr is None:
            continue
        out.append({"dtype": dtype, "prefix": TARGET_PREFIX, "slots": TARGET_SLOTS, "slot_len": length,
                    "flex_speedup_vs_replicated": rep / fl, "triton_speedup_vs_replicated": rep / tr,
                    "triton_vs_flex": fl / tr,
                    "met": rep / fl >= 1.5 and rep / tr >= 1.5 and tr <= fl})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = sorted({r["prefix"] for r in rows})
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(2, len(prefixes), figsize=(4.2 * len(prefixes), 7), squeeze=False)
    colors = {"sdpa": "tab:blue", "replicated": "tab:red", "flex": "tab:green", "triton": "tab:purple"}
    styles = {8: "-", 32: "--"}
    for j, p in enumerate(prefixes):
        for b in ALL_BACKENDS:
            for length in sorted({r["slot_len"] for r in rows}):
                for dt in dtypes:
                    sel = sorted((r for r in rows if r["prefix"] == p and r["backend"] == b
                                  and r["slot_len"] == length and r["dtype"] == dt), key=lambda r: r["slots"])
                    if not sel:
                        continue
                    ks = [r["slots"] for r in sel]
                    label = f"{b} L={length}" + (f" {dt}" if len(dtypes) > 1 else "")
                    kw = dict(color=colors[b], linestyle=styles.get(length, ":"), marker="o" if dt == dtypes[0] else "x",
                              label=label)
                    axes[0][j].plot(ks, [r["ms_median"] for r in sel], **kw)
                    mem = [r.get("peak_bytes", r["extra_bytes"]) / 2**20 for r in sel]
                    axes[1][j].plot(ks, mem, **kw)
        axes[0][j].set_title(f"prefix {p}")
        axes[0][j].set_ylabel("ms per call (median)")
        axes[1][j].set_ylabel("MiB " + ("peak above inputs" if "peak_bytes" in rows[0] else "built beyond q/k/v/out"))
        for i in (0, 1):
            axes[i][j].set_xlabel("slots k")
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_xticks(sorted({r["slots"] for r in rows}), [str(k) for k in sorted({r["slots"] for r in rows})])
            axes[i][j].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Packed slot attention, Qwen3-8B shapes (32/8 heads, head_dim 128)")
    fig.tight_layout()
    from harness.run.store import atomic_save_figure

    atomic_save_figure(fig, path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness bench-kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=os.environ.get("DEVICE") or "cpu", help="cpu or cuda (env DEVICE)")
    p.add_argument("--prefixes", default="256,1024,4096")
    p.add_argument("--slots", default="1,4,8,16")
    p.add_argument("--slot-lens", default="8,32")
    p.add_argument("--backends", default=None, help="subset of sdpa,replicated,flex,triton (default: all the device runs)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 5 on CPU, 20 on CUDA)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke test: prefixes 256,1024, slots 1,8, slot length 8, 2 repeats")
    p.add_argument("--host", default=os.environ.get("BENCH_HOST", "shared"),
                   help="a note on the machine's state, kept in the JSON (e.g. idle, shared)")
    p.add_argument("--out", default=str(REPO / "results" / "bench_kernels.json"))
    p.add_argument("--plot", default=str(REPO / "reports" / "kernels.png"))
    return p


def _settings(a: argparse.Namespace) -> tuple[list[int], list[int], list[int], tuple[str, ...], int]:
    """(prefixes, slot counts, slot lengths, backends, repeats) from the options; ValueError names a bad one."""
    prefixes = _ints("256,1024" if a.quick else a.prefixes, "prefixes")
    slots = _ints("1,8" if a.quick else a.slots, "slots")
    lens = _ints("8" if a.quick else a.slot_lens, "slot-lens")
    if a.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {a.device!r}")
    default = ALL_BACKENDS if a.device == "cuda" else CPU_BACKENDS
    backends = default if a.backends is None else tuple(x.strip() for x in a.backends.split(",") if x.strip())
    bad = [b for b in backends if b not in ALL_BACKENDS]
    if bad or not backends:
        raise ValueError(f"--backends must be a comma list of {', '.join(ALL_BACKENDS)}, got {a.backends!r}")
    repeats = a.repeats if a.repeats is not None else (2 if a.quick else (20 if a.device == "cuda" else 5))
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    return prefixes, slots, lens, backends, repeats


def _run_grid(backends, dtypes, device, prefixes, slots, lens, repeats: int) -> list[dict]:
    """One row per (dtype, slot length, slot count, prefix, backend), a progress line per shape on stderr."""
    rows = []
    total = len(dtypes) * len(prefixes) * len(slots) * len(lens)
    print(f"bench-kernels: {total} shapes x {len(backends)} backends on {device.type}; flex compiles once per query "
          "bucket on first use (~20 s each on a CPU)", file=sys.stderr, flush=True)
    t_start = time.perf_counter()
    done = 0
    # Slot count and length outermost: the flex query bucket (n = k * L) changes least often.
    for dtype in dtypes:
        for length in lens:
            for k in slots:
                for prefix in prefixes:
                    line = []
                    for row in bench_shape(backends, dtype, device, prefix, k, length, repeats):
                        rows.append(row)
                        line.append(f"{row['backend']} {row['ms_median']:8.2f} ms")
                    done += 1
                    print(f"[{done}/{total}] {str(dtype).removeprefix('torch.'):<8} P={prefix:<5} k={k:<3} L={length:<3} "
                          + "  ".join(line) + f"  ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    return rows


def _environment(a: argparse.Namespace, device) -> dict:
    """The run's environment record, with the host note, the device's name and triton's version."""
    import torch

    from harness.run.environment import environment

    env = {**environment(a.device, a.threads, 1, 0), "host": a.host,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    env["device_name"] = env["device_name"] or env["cpu"]
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        prefixes, slots, lens, backends, repeats = _settings(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import torch

    from harness.run.store import atomic_write_json
    from refusion.kernels import missing

    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: this torch sees no CUDA device (make bench-kernels DEVICE=cuda on a GPU machine)",
              file=sys.stderr)
        return 2
    if "sdpa" not in backends:
        backends = ("sdpa", *backends)  # the reference every output is compared with
    device = torch.device(a.device)
    for b in backends:
        why = missing(b, device)
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return 2
    torch.set_num_threads(a.threads)
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    t_start = time.perf_counter()
    rows = _run_grid(backends, dtypes, device, prefixes, slots, lens, repeats)
    report = {
        "command": "python -m harness bench-kernels " + " ".join(argv if argv is not None else sys.argv[1:]),
        "env": _environment(a, device),
        "shapes": {"batch": 1, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "prefixes": prefixes,
                   "slots": slots, "slot_lens": lens, "repeats": repeats, "quick": a.quick},
        "notes": ("ms_median / ms_min over --repeats rounds in which every backend of a shape makes one call in "
                  "ABBA order (harness/run/timing.py), after one warm-up call each (first_call_s, which includes "
                  "the flex compile); extra_bytes: built beyond q/k/v/out by construction; peak_bytes (CUDA): "
                  "measured peak above the inputs. Speed is judged on a GPU: on a CPU the point is memory."),
        "rows": rows,
        "targets": targets(rows) if device.type == "cuda" else "speed targets are checked on CUDA only",
        "seconds": time.perf_counter() - t_start,
    }
    if device.type == "cpu":
        report["gpu"] = "no GPU was used for this file; run `make bench-kernels DEVICE=cuda` on a CUDA machine"
    atomic_write_json(a.out, report)
    plot(rows, Path(a.plot))
    print(f"wrote {a.out} and {a.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
