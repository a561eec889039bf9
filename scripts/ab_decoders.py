"""A/B timing of the decoders of two commits, interleaved in one process on the tiny checkpoints.

    nice -n 10 python scripts/ab_decoders.py --base <commit> [--reps 7] [--decoders ar,refusion,...]

B is the working tree's ``refusion/`` (imported as ``refusion``); A is ``refusion/`` of the commit
``--base``, extracted with ``git archive`` into a temporary folder and imported as the package
``refusion_base`` (the decoders import each other relatively, so a renamed copy is self-contained).
Both decode the same prompts (embedded_math / code / choice test item 0, each at its task's
gen_length, batch 1) with the same model objects, one torch thread; each repetition runs A then B
for every decoder, the next B then A (ABBA), so drift on a shared machine hits both alike. Reports,
per decoder, the median seconds of A and B over the repetitions and the median of the per-repetition
ratios B / A, after checking that both return the same tokens and the same NFE. Timings are only
comparable inside one run.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the working tree's packages, wherever the script is started from

from harness.models.checkpoints import load_model  # noqa: E402
from harness.run.presets import PRESETS, REGRESS_MODELS  # noqa: E402
from tasks.embedded import load_split  # noqa: E402
from tasks.info import TASKS  # noqa: E402

DEFAULT_DECODERS = ",".join(REGRESS_MODELS)  # the presets make regress checks


def base_package(commit: str, into: Path):
    """`refusion/` of `commit` importable as `refusion_base` (returns its decoding registry module)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "refusion"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "refusion").rename(into / "refusion_base")
    sys.path.insert(0, str(into))
    return importlib.import_module("refusion_base.decoding")


def prompts(tokenizer) -> list[tuple[torch.Tensor, int]]:
    """(ids [1, P], gen_length) of item 0 of each embedded kind, chat-templated."""
    out = []
    for kind in ("math", "code", "choice"):
        text = tokenizer.apply_chat_template([{"role": "user", "content": load_split(kind, "test")[0]["query"]}],
                                             tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        out.append((ids, TASKS[f"embedded_{kind}"].gen_length))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit whose decoders are A")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--decoders", default=DEFAULT_DECODERS, help="presets (harness/run/presets.py), comma-separated")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    import refusion.decoding as new

    with tempfile.TemporaryDirectory(prefix="ab-decoders-") as tmp:
        old = base_package(ns.base, Path(tmp))
        cases = []
        for name in ns.decoders.split(","):
            spec = PRESETS[name]
            loaded = load_model(str(REPO / spec.checkpoint))
            special = {"eos_token_id": list(loaded.eos_ids), "mask_token_id": loaded.mask_id}
            cases.append((name, spec, loaded.model, prompts(loaded.tokenizer), special))

        def run(registry, spec, model, items, special):
            t0 = time.perf_counter()
            outs = [registry.DECODERS[spec.decoder](model, ids, None, {**spec.knobs, "gen_length": g}, **special)
                    for ids, g in items]
            return time.perf_counter() - t0, outs

        times = {name: {"A": [], "B": []} for name, *_ in cases}
        for case in cases:  # warm-up, and the same tokens and NFE from both
            (_, a), (_, b) = run(old, *case[1:]), run(new, *case[1:])
            for (ta, sa), (tb, sb) in zip(a, b):
                assert all(torch.equal(x, y) for x, y in zip(ta, tb)) and sa["nfe"] == sb["nfe"], case[0]
        for rep in range(ns.reps):
            order = (("A", old), ("B", new)) if rep % 2 == 0 else (("B", new), ("A", old))
            for name, *rest in cases:
                for tag, registry in order:
                    times[name][tag].append(run(registry, *rest)[0])
    print(f"A = {ns.base[:10]}, B = working tree; {ns.reps} repetitions (ABBA), 1 thread; seconds per 3 prompts")
    print(f"{'decoder':<12} {'A median':>9} {'B median':>9} {'B/A (median of ratios)':>24} {'min..max':>12}")
    for name, t in times.items():
        ratios = [b / a for a, b in zip(t["A"], t["B"])]
        print(f"{name:<12} {statistics.median(t['A']):9.4f} {statistics.median(t['B']):9.4f} "
              f"{statistics.median(ratios):24.3f} {min(ratios):5.3f}..{max(ratios):5.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
