"""A test double of the engine server (tests/test_engine.py, the ``fake_engine`` fixture): a real HTTP server
(stdlib http.server) that speaks the subset of vLLM's OpenAI-compatible API the harness uses, so the client and
the server's lifecycle (harness/run/engine.py) run for real in CI without vLLM.

    python tests/engine_double.py --port P [--mode ok|crash|never-healthy] [--child] [--eos ID]

- ``GET /health``: 200 (``never-healthy``: 503 forever; ``crash``: the process exits with code 3 at once);
- ``POST /v1/completions`` with ``prompt`` a list of token ids: greedy tokens by a fixed rule, token ``i`` of
  the answer = (last prompt id + 1 + i) % 50, cut after the first of ``stop_token_ids`` or at ``max_tokens``,
  returned as ``choices[0].token_ids``; with ``--eos ID`` also after ID, unless the request sets
  ``ignore_eos``; a prompt whose last id is 999 makes the server exit (a crash while serving);
- ``--child``: like vLLM's engine core, a second process below the server, which leaves its session (setsid)
  and sleeps: stopping the server must take it too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 50
CRASH_ID = 999


def answer(prompt: list[int], max_tokens: int, stop: list[int], eos: int | None = None,
           ignore_eos: bool = False) -> list[int]:
    out = []
    for i in range(max_tokens):
        t = (prompt[-1] + 1 + i) % VOCAB
        out.append(t)
        if t in stop or (t == eos and not ignore_eos):
            break
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=("ok", "crash", "never-healthy"), default="ok")
    p.add_argument("--child", action="store_true")
    p.add_argument("--eos", type=int, default=None, help="the model's own EOS: answers stop there unless the "
                   "request sets ignore_eos (as vLLM stops at the tokenizer's EOS)")
    ns = p.parse_args()
    if ns.mode == "crash":
        return 3
    if ns.child:
        subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(3600)"])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the log file gets errors only
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(503 if ns.mode == "never-healthy" else 200, {})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._send(404, {"error": "not found"})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
                self._send(400, {"error": "prompt must be a non-empty list of token ids"})
                return
            if prompt[-1] == CRASH_ID:
                os._exit(5)
            toks = answer(prompt, int(body["max_tokens"]), list(body.get("stop_token_ids") or []), ns.eos,
                          bool(body.get("ignore_eos")))
            self._send(200, {"choices": [{"index": 0, "text": "", "token_ids": toks}],
                             "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(toks)}})

    ThreadingHTTPServer(("127.0.0.1", ns.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
