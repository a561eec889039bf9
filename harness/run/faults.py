"""Faults of a long run, what the harness makes of them, and the test hook that injects them.

docs/design.md "Faults" lists each fault, what the harness does, and the test that shows it:

- an item fault (``item_fault``): out of memory, ``refusion.decoding.common.ItemFault`` (non-finite
  logits, a forward budget run past). The batch is retried in halves down to one row
  (``lm_records.Records``); a row that still fails is a failed item: journaled and counted, scored
  as wrong (an empty answer), named at the end of the run, retried by ``--retry-failed``;
- a full disk or quota (``disk_full``): one ``error:`` line naming the path and the free space, exit 2;
  every write is atomic (``store``), so a resume after space is freed completes the run;
- a stop signal (``STOP_SIGNALS``: SIGTERM, SIGINT, and SIGUSR1 as Slurm's ``--signal`` sends it): the
  journal keeps every finished sample, the run exits 128 + the signal and resumes with its run id.

``FAULTS_ENV`` is a test hook (environment only, never a knob or an option): a JSON object that makes a
real run meet a fault at a chosen place, however fast the machine is. Keys:

- ``"oom": {"min_batch": N}``: every decoder call of at least N rows raises out of memory;
  ``"oom": {"docs": ["task:doc_id", ...]}``: every call holding one of those documents does;
- ``"nan": {"docs": [...], "forward": K}``: forward K (1-based) of every call holding one of those
  documents returns NaN logits (a forward hook on the LM head, else on the model: the decoder's own check
  must catch it);
  ``"nan": {"first_calls": N}``: the first N decoder calls of every process (the decoding pass's worker, the
  timed rounds, the memory pass) do, whatever they hold: a fault that meets each process once;
- ``"stall": {"docs": [...], "forwards": N}``: every call holding one of those documents meets a model whose
  confidences never pass a threshold (all logits equal, as the conformance suite's ``budget`` rule builds it)
  under a forward budget cut to N forwards a row (``common.FORWARDS_PER_TOKEN``/``FORWARDS_EXTRA``), so the
  decoder's own budget check stops it as it would stop a sample that never ends;
- ``"leak": {"decoders": ["refusion", ...]}``: every call of those decoders keeps every forward's logits
  until the call ends (a forward hook appends them to a list): the leak a trace added to a decoder would
  make. Tokens do not change; the memory pass's decode peak grows, which ``make regress`` must catch on that
  decoder's figures alone;
- ``"slow": {"decoders": ["refusion", ...], "factor": F}``: every forward of those decoders' models is
  followed by CPU work (a busy loop) lasting (F - 1) x that forward's own seconds, so the decoder runs about F
  times as long on the same work and tokens: the slowdown `make compare`'s calibration must detect
  (harness/speed/spread.py);
- ``"enospc": "SITE"``: the first write whose file name contains SITE fails with ENOSPC halfway
  (``store.maybe_fail_write``; once per process);
- ``"pause": "POINT"``: the process prints ``paused at POINT`` to stderr and waits for a signal at a
  named point (``pause_at``): ``results`` (the worker, after lm-eval's results, before the metrics),
  ``finalize`` (the runner, before the summary), ``report`` (``harness report``, before its folder
  is swapped in).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Iterator

FAULTS_ENV = "REFUSION_BENCH_FAULTS"
# Slurm's `--signal=USR1@T` (and `scancel --signal`) warn a job before its time or preemption runs out.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def injected() -> dict[str, Any]:
    """The test hook's faults (module doc); {} when unset."""
    raw = os.environ.get(FAULTS_ENV)
    if not raw:
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"{FAULTS_ENV} must be a JSON object, got {raw!r}")
    return value


def pause_at(point: str) -> None:
    """Test hook: wait for a signal at ``point`` when ``FAULTS_ENV`` names it (module doc)."""
    if injected().get("pause") == point:
        print(f"{FAULTS_ENV}: paused at {point}", file=sys.stderr, flush=True)
        while True:
            signal.pause()


# ---------------------------------------------------------------- item faults


def is_oom(exc: BaseException) -> bool:
    """The device's out-of-memory error: ``torch.OutOfMemoryError`` (CUDA and other accelerators), or a
    ``MemoryError`` raised by the decode on the CPU."""
    import torch

    return isinstance(exc, (torch.OutOfMemoryError, MemoryError))


def item_fault(exc: BaseException) -> str | None:
    """The reason an item fails for ``exc`` (one line), or None when ``exc`` is not an item fault and
    must stop the run (a bug shows as a bug)."""
    from refusion.decoding.common import ItemFault

    if is_oom(exc):
        return "out of memory"
    if isinstance(exc, ItemFault):
        return str(exc)
    return None


def free_device_memory() -> None:
    """After an out-of-memory error: hand cached blocks back before the retry."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _doc(item: dict) -> str:
    return f"{item['task']}:{item['doc_id']}"


_CALLS = [0]  # the test hook's count of this process's decoder calls ("first_calls")


@contextlib.contextmanager
def injected_decode_faults(model, items: list[dict], decoder: str | None = None) -> Iterator[None]:
    """Test hook: raise, poison or leak in this decoder call as ``FAULTS_ENV`` asks for these items and this
    ``decoder`` (module doc)."""
    faults = injected()
    oom = faults.get("oom") or {}
    if len(items) >= int(oom.get("min_batch", 10**9)) or any(_doc(it) in oom.get("docs", ()) for it in items):
        import torch

        raise torch.OutOfMemoryError(f"{FAULTS_ENV}: injected out of memory ({len(items)} rows)")
    nan, stall = faults.get("nan") or {}, faults.get("stall") or {}
    _CALLS[0] += 1  # this process's decoder calls so far, this one included
    poisoned = any(_doc(it) in nan.get("docs", ()) for it in items) or _CALLS[0] <= int(nan.get("first_calls", 0))
    stalled = any(_doc(it) in stall.get("docs", ()) for it in items)
    leaking = decoder is not None and decoder in (faults.get("leak") or {}).get("decoders", ())
    slow = faults.get("slow") or {}
    slowed = decoder is not None and decoder in slow.get("decoders", ())
    if not (poisoned or stalled or leaking or slowed):
        yield
        return
    kept: list = []  # the leak: every forward's logits, alive until the call ends
    import torch

    from refusion.decoding import common

    seen, hit = [0], []  # forwards so far, the encoder half's of an encoder-decoder model (DiffusionGemma) too
    # The faults meet the LM head's output where the model has one: every logit a decoder reads passes through it,
    # also those a streamed step makes from hidden states after the forward (the knob logits_chunk).
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def count(*_):
        seen[0] += 1

    def poison(_module, _args, out):
        logits = out if head is not None else out.logits
        if poisoned and not hit and seen[0] >= int(nan.get("forward", 1)):  # the first logits at or after it
            hit.append(seen[0])
            logits = logits.float().fill_(float("nan"))
        elif stalled:
            logits = torch.zeros_like(logits)  # every confidence 1/V: no threshold is ever passed
        if leaking:
            kept.append(logits)
        if head is not None:
            return logits
        out.logits = logits
        return out

    handles = [model.register_forward_pre_hook(count)]
    if poisoned or stalled or leaking:
        handles.append((head or model).register_forward_hook(poison))
    if slowed:
        import time

        started = [0.0]
        extra = float(slow.get("factor", 1.0)) - 1.0

        def begin(_module, _args):
            started[0] = time.perf_counter()

        def burn(_module, _args, _out):
            until = time.perf_counter() + extra * (time.perf_counter() - started[0])
            while time.perf_counter() < until:  # CPU work, not a sleep: the slowdown shows in CPU time too
                pass

        handles += [model.register_forward_pre_hook(begin), model.register_forward_hook(burn)]
    encoder = getattr(getattr(model, "model", None), "encoder", None)  # its forwards write a cache, no logits
    if encoder is not None:
        handles.append(encoder.register_forward_hook(lambda *_: seen.__setitem__(0, seen[0] + 1)))
    saved = common.FORWARDS_PER_TOKEN, common.FORWARDS_EXTRA
    if stalled:
        common.FORWARDS_PER_TOKEN, common.FORWARDS_EXTRA = 0, int(stall.get("forwards", 1))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        common.FORWARDS_PER_TOKEN, common.FORWARDS_EXTRA = saved
        kept.clear()


# ---------------------------------------------------------------- a full disk

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException) -> str | None:
    """One line for a write that failed on a full disk or quota, wherever in the chain; else None."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return _disk_full_line(e)
        e = e.__cause__ or e.__context__
    return None


def _disk_full_line(e: OSError) -> str:
    path = Path(e.filename) if e.filename else None
    what = "disk quota exceeded" if e.errno == errno.EDQUOT else "no space left on the device"
    where = f" writing {path}" if path else ""
    free = ""
    probe = path
    while probe is not None and not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe is not None:
        with contextlib.suppress(OSError):
            free = f" ({_size(shutil.disk_usage(probe).free)} free there)"
    return f"{what}{where}{free}; nothing was half-written: free some space (or raise the quota)"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
