"""The engine row's decoder (decoder ``ar@vllm``, docs/engines.md): the ``ar`` decoder's interface, served by an
engine server (harness/run/engine.py) instead of a forward loop in this process.

``DecoderCall`` (harness/run/lm_decode.py) calls it as it calls ``ar``: left-padded ids [B, P] and the padding
mask [B, P] in, one 1-D response per row out, cut after its first EOS, with the harness's EOS set as the
server's stop ids. Each row's real prompt ids (the padding dropped) go to the server as a token-id prompt,
all B rows at once; the tokens come back as ids, so the engine row sees the same prompts, chat template and
stop rules as the transformers ``ar`` row, and its text is cut and scored by the same code.

``ignore_eos=True`` (with no ``eos_token_id``): no stop at all, not even at the model's own EOS, so every row
gets ``gen_length`` tokens (the fixed work of harness/speed/scaling.py).

Stats: ``nfe`` is the longest row's token count (one engine step per token), ``timings.forward_s`` the call's
wall time at the client, ``row_latency_s`` each request's own seconds at the client, ``engine_cpu_s`` the CPU
seconds of the server's process tree during the call (the work happens there, not in this process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from harness.run.engine import (EngineClient, EngineServer, EngineSpec, check_engine, free_port,
                                server_command)


class EngineDecoder:
    """A started engine server on one checkpoint, callable like a decoder (module doc). ``close()`` stops it."""

    def __init__(self, base, spec: EngineSpec, folder: str, dtype: str, device: str, log_path: Path) -> None:
        self.base = base  # the registry's ar decoder: its knobs and flags
        self.name, self.knobs, self.batched, self.family = "ar", base.knobs, True, None
        self.spec = spec
        self.versions = check_engine(spec)
        port = free_port()
        env = {}
        if not device.startswith("cuda"):
            # The CPU worker binds its OpenMP threads; the harness's --threads share is the server's too.
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        self.server = EngineServer(server_command(spec, folder, port, dtype, device), port, log_path,
                                   health_timeout_s=spec.health_timeout_s, name=spec.engine, env=env).start()
        self.client = EngineClient(self.server.url, spec.request_timeout_s)
        self._pids = self.server.pids()

    def __getattr__(self, item: str) -> Any:
        return getattr(self.base, item)

    def wait_quiet(self) -> float:
        return self.server.wait_quiet()

    def close(self) -> None:
        self.server.stop()

    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, knobs=None, *,
                 eos_token_id=None, mask_token_id=None, ignore_eos: bool = False,
                 **_) -> tuple[list[torch.Tensor], dict]:
        rows = input_ids.tolist()  # [B][P]
        if attention_mask is not None:
            rows = [[t for t, m in zip(r, mr) if m] for r, mr in zip(rows, attention_mask.tolist())]
        eos = [int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])
               if e is not None]
        temperature = float(getattr(knobs, "temperature", 0.0) or 0.0)
        seed = int(getattr(knobs, "seed", 0)) if temperature > 0 else None
        cpu0 = self.server.cpu_s(self._pids)
        got = self.client.complete_many(rows, int(knobs.gen_length), eos, temperature, seed, ignore_eos)
        cpu = self.server.cpu_s(self._pids) - cpu0
        out, lat = [], []
        for toks, wall in got:
            cut = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))  # after the first EOS, as ar
            out.append(torch.tensor(toks[:cut], dtype=torch.long))
            lat.append(wall)
        wall = max(lat)
        return out, {"nfe": max(len(t) for t in out), "timings": {"forward_s": wall}, "row_latency_s": lat,
                     "engine_cpu_s": cpu}
