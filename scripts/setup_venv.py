"""`make setup`'s install into an existing venv: the locked list, then the project (editable, test extra).

    .venv/bin/python scripts/setup_venv.py --lock requirements/lock.txt [--extra test] [--pip-only]
    .venv/bin/python scripts/setup_venv.py --pins "mkdocs==1.6.1 ..."     # more pins, resolved (make docs)

The fast path uses uv (a pinned release, installed into the venv by pip first): uv unpacks and links the
wheels of requirements/lock.txt in parallel (--no-deps: nothing to resolve), then resolves
``-e '.[test]'`` against pyproject.toml, whose pins decide; whatever the list lacks here (CUDA torch's
nvidia-* packages from PyPI) is added. uv reads no pip configuration, so pip's own settings (``pip config
list``: index-url, extra-index-url, find-links, constraint, cert; from files and PIP_* variables) are
passed to it as flags, and both consider every index the way pip does (unsafe-best-match): a machine whose
pip offers a local CPU wheel of torch gets that wheel either way.

Where any step of the fast path fails (uv cannot be installed, the list does not install on this
platform), one line says so and pip does it all: the locked list as two halves in two pip processes at
once, then the resolving ``pip install -e '.[test]'``, which installs everything where the list did not.
A torch==<pin> already in the venv (a build you installed yourself) is kept on both paths: the pin is
satisfied.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV = "uv==0.13.9"
PIP = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
# pip config keys passed on to uv: key -> (uv flag, several values allowed)
PIP_KEYS = {"index-url": ("--index-url", False), "extra-index-url": ("--extra-index-url", True),
            "find-links": ("--find-links", True), "constraint": ("--constraint", True)}


def locked_pins(lock: Path) -> list[str]:
    """The pins of the lock file (lines that start with a package name; comments and blanks skipped)."""
    return [x.strip() for x in lock.read_text(encoding="utf-8").splitlines() if x[:1].isalnum()]


def pip_config(text: str) -> dict[str, list[str]]:
    """``pip config list`` output -> {key: values}. A PIP_* variable (``:env:.key``) replaces the files'
    value of its key, as in pip; a value with spaces holds several (``extra-index-url = a b``)."""
    files: dict[str, list[str]] = {}
    env: dict[str, list[str]] = {}
    for line in text.splitlines():
        scope, _, rest = line.partition(".")
        key, eq, val = rest.partition("=")
        if not eq or scope not in (":env:", "global", "install"):
            continue
        vals = shlex.split(val)[0].split() if val.strip() else []
        (env if scope == ":env:" else files).setdefault(key.strip(), []).extend(vals)
    return {**files, **env}


def uv_flags(cfg: dict[str, list[str]]) -> list[str]:
    """uv flags that make it see what pip sees."""
    out = ["--index-strategy", "unsafe-best-match"]
    for key, (flag, many) in PIP_KEYS.items():
        for v in (cfg.get(key) or [])[: None if many else 1]:
            out += [flag, v]
    return out


def run(cmd: list[str], env: dict | None = None) -> bool:
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0


def uv_command() -> tuple[list[str], dict] | None:
    """``uv pip install`` for this venv with pip's settings, and its environment; None when uv cannot be had."""
    have = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True, text=True)
    if not (have.returncode == 0 and have.stdout.split()[1:2] == [UV.split("==")[1]]) and not run(PIP + [UV]):
        return None
    got = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    cfg = pip_config(got.stdout if got.returncode == 0 else "")
    env = dict(os.environ)
    if cfg.get("cert") and "SSL_CERT_FILE" not in env:
        env["SSL_CERT_FILE"] = cfg["cert"][0]
    return [sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", sys.executable, *uv_flags(cfg)], env


def with_uv(pins: list[str], extra: str, lockfile: Path) -> str | None:
    """The fast path; None when done, else the step that failed (for the one line)."""
    got = uv_command()
    if got is None:
        return f"pip could not install {UV}"
    uv, env = got
    if not run(uv + ["--no-deps", "-r", str(lockfile)], env):
        return f"uv could not install the locked list ({len(pins)} pins)"
    if not run(uv + ["--no-build-isolation", "-e", f".[{extra}]"], env):
        return "uv could not install the project"
    return None


def with_pip(pins: list[str], extra: str, tmp: Path) -> int:
    """The plain path: the list in two halves at once (pip unpacks one wheel at a time), then the resolving
    install of the project, which installs everything where the list did not."""
    halves = [tmp / "lock-0.txt", tmp / "lock-1.txt"]
    for i, h in enumerate(halves):
        h.write_text("\n".join(pins[i::2]) + "\n", encoding="utf-8")
    procs = [subprocess.Popen(PIP + ["--no-deps", "-r", str(h)], cwd=ROOT) for h in halves]
    ok = all([p.wait() == 0 for p in procs])
    if not ok:
        print("setup: the locked list did not install here; resolving from pyproject.toml", file=sys.stderr)
    return 0 if run(PIP + (["--no-build-isolation"] if ok else []) + ["-e", f".[{extra}]"]) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lock", type=Path, default=ROOT / "requirements" / "lock.txt", help="the locked list")
    p.add_argument("--extra", default="test", help="the project's extra to install (default: test)")
    p.add_argument("--pip-only", action="store_true", help="skip uv: pip does it all")
    p.add_argument("--pins", help="install these requirements (space-separated, resolved) instead of the lock and "
                                  "the project")
    ns = p.parse_args(argv)
    if ns.pins is not None:
        reqs = ns.pins.split()
        got = None if ns.pip_only else uv_command()
        if got is not None and run(got[0] + reqs, got[1]):
            return 0
        if not ns.pip_only:
            print("setup: uv could not install them; pip installs instead", file=sys.stderr)
        return 0 if run(PIP + reqs) else 1
    if not ns.lock.is_file():
        print(f"error: no lock file {ns.lock}", file=sys.stderr)
        return 2
    pins = locked_pins(ns.lock)
    with tempfile.TemporaryDirectory(prefix="refusion-setup-") as d:
        lockfile = Path(d) / "lock.txt"
        lockfile.write_text("\n".join(pins) + "\n", encoding="utf-8")
        if not ns.pip_only:
            why = with_uv(pins, ns.extra, lockfile)
            if why is None:
                return 0
            print(f"setup: {why}; pip installs instead", file=sys.stderr)
        return with_pip(pins, ns.extra, Path(d))


if __name__ == "__main__":
    sys.exit(main())
