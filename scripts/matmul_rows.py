"""Which row counts of the LM head's matmul round like the full product, under each `make test-cpus` setting.

The knob logits_chunk makes a step's logits with the LM head over the decided positions only (B x chunk rows)
where the model's own forward multiplies every forwarded position (B x q rows). A BLAS picks its kernel (and a
thread split) by the matrix shape, so row i of ``hidden[rows] @ W.T`` can differ in its last bit from row i of
``hidden @ W.T``. This measures, for each setting of scripts/test_cpus.py (each in a fresh process: the
variables are read when the libraries load), each dtype, hidden size and full row count, the subset row counts
(1-64, taken at the start and at the end of the rows) whose product is not bitwise the full product's rows.

    python scripts/matmul_rows.py                 # every setting -> results/matmul_rows.json
    python scripts/matmul_rows.py --settings native,mkl-avx2

Tokens are another matter: a last-bit change moves a token only where two scores tie within rounding;
tests/test_streamed_logits.py checks the tokens, and `make test-cpus` runs it under every setting.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cpus import SETTINGS, env_for  # noqa: E402

from harness.run.store import atomic_write_json  # noqa: E402
from harness.speed.ab import machine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "results" / "matmul_rows.json"
SHAPES = ((256, 915), (4096, 2048))  # (hidden, vocabulary): the tiny checkpoints' head; a released hidden size
FULL_ROWS = (32, 96, 300, 768)
SUBSET_ROWS = tuple(range(1, 33)) + (48, 64)

PROBE = """
import json, os, sys, torch
torch.manual_seed(0)
torch.set_num_threads(int(os.environ.get("REFUSION_TEST_THREADS", "1")))
shapes, fulls, subs = json.loads(sys.argv[1])
out = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(), "differ": {}}
for dtype in (torch.float32, torch.bfloat16):
    for hidden, vocab in shapes:
        w = torch.randn(vocab, hidden).to(dtype)
        for full_rows in fulls:
            x = torch.randn(full_rows, hidden).to(dtype)
            full = torch.nn.functional.linear(x, w)
            bad = sorted({r for r in subs if r < full_rows for a in (0, full_rows - r)
                          if not torch.equal(torch.nn.functional.linear(x[a:a + r].contiguous(), w), full[a:a + r])})
            out["differ"][f"{str(dtype).removeprefix('torch.')} hidden {hidden} full {full_rows}"] = bad
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names (default: all)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    names = [s for s in args.settings.split(",") if s]
    bad = sorted(set(names) - set(SETTINGS))
    if bad:
        ap.error(f"unknown setting(s) {', '.join(bad)}; valid: {', '.join(SETTINGS)}")
    spec = json.dumps([SHAPES, FULL_ROWS, SUBSET_ROWS])
    runs = []
    for name in names:
        r = subprocess.run([sys.executable, "-c", PROBE, spec], env=env_for(name), capture_output=True, text=True,
                           timeout=600, cwd=REPO)
        if r.returncode:
            print(f"{name}: failed: {r.stderr.strip()[-500:]}", file=sys.stderr)
            return 1
        got = json.loads(r.stdout)
        runs.append({"setting": name, "env": SETTINGS[name], **got})
        equal = [k for k, v in got["differ"].items() if not v]
        print(f"{name} ({got['capability']}, {got['threads']} threads): bitwise equal at every subset for "
              f"{len(equal)} of {len(got['differ'])} (dtype, hidden, full rows)")
    atomic_write_json(args.out, {"made": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                 "cpu": machine().get("cpu"), "shapes": SHAPES, "full_rows": FULL_ROWS,
                                 "subset_rows": SUBSET_ROWS, "runs": runs,
                                 "what": "per setting, (dtype, hidden, full row count) -> the subset row counts "
                                         "whose rows of hidden[rows] @ W.T differ bitwise from the full product's"})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
