"""One side of `make regress`'s speed A/B (harness/speed/ab.py): a persistent process that decodes with
the code of one source tree.

    python harness/speed/ab_worker.py --tree <source tree> --threads 1

Run as a script (not ``-m``), so that ``--tree`` goes first on ``sys.path`` and ``refusion`` and
``harness`` are imported from that tree (the baseline commit's code, or the current one) and not from
the installed project. Reads one JSON request per line on stdin and answers one JSON line on stdout:

    {"op": "decode", "checkpoint": <folder>, "decoder": <registry name>, "knobs": {...},
     "ids": [<prompt token ids>]}
    -> {"ok": true, "seconds": <CPU seconds of the decoder call>, "wall_seconds": <its wall-clock seconds>,
        "tokens": N, "nfe": K}
    {"op": "quit"}

The checkpoint is loaded once (by the tree's own loader) and kept. Only the decoder call is timed. Any
failure answers {"ok": false, "error": "<one line>"} and the process goes on. Uses only the interface
every decoder has had since the registry existed: ``harness.models.checkpoints.load_model`` and
``refusion.decoding.DECODERS[name](model, ids, None, knobs, eos_token_id=, mask_token_id=)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help="source tree whose refusion/ and harness/ are imported")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    tree = os.path.realpath(a.tree)
    sys.path[:] = [tree] + [x for x in sys.path if os.path.realpath(x or ".") != os.path.dirname(__file__)]
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the tree prints goes to stderr; stdout carries the answers only
    try:
        import torch

        import refusion
        from harness.models.checkpoints import load_model
        from refusion.decoding import DECODERS
        where = os.path.realpath(refusion.__file__)
        if not where.startswith(tree + os.sep):
            raise ImportError(f"refusion imported from {where}, not from {tree}")
        torch.set_num_threads(a.threads)
        torch.manual_seed(0)
    except Exception as e:  # noqa: BLE001: the driver shows it in one line
        out.write(json.dumps({"ok": False, "error": f"cannot import the tree's code: {type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return 2
    out.write(json.dumps({"ok": True, "ready": True, "torch": torch.__version__}) + "\n")
    out.flush()
    loaded: dict[str, object] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            if req["checkpoint"] not in loaded:
                loaded[req["checkpoint"]] = load_model(req["checkpoint"])
            lm = loaded[req["checkpoint"]]
            dec = DECODERS[req["decoder"]]
            ids = torch.tensor([req["ids"]])
            special = {"eos_token_id": list(lm.eos_ids), "mask_token_id": lm.mask_id}
            # CPU seconds of this (one-thread) process: the time another process takes the core does not count,
            # so a busy machine widens neither side; what the code does (a slower step is more work) does.
            c0, t0 = time.process_time(), time.perf_counter()
            _, stats = dec(lm.model, ids, None, dict(req["knobs"]), **special)
            secs, wall = time.process_time() - c0, time.perf_counter() - t0
            ans = {"ok": True, "seconds": secs, "wall_seconds": wall, "tokens": int(stats["generated_tokens"]),
                   "nfe": int(stats["nfe"])}
        except Exception as e:  # noqa: BLE001
            ans = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        out.write(json.dumps(ans) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
