"""The engine row's client and server lifecycle (harness/run/engine.py) against the engine's test double
(tests/engine_double.py: a real HTTP server with the API subset), and how an engine row is named and checked
(MODELS ``ar@vllm``, its knobs, a broken venv). The real vLLM runs in `make test-engine`
(`python -m harness engine-check`), where .venv-vllm exists."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.run.engine import (EngineClient, EngineError, EngineSpec, check_engine, descendants, port_free,
                                server_command, split_decoder, split_knobs)
from harness.run.model_list import InputError, load_models_file, parse_models

REPO = Path(__file__).resolve().parents[1]


def answer(prompt: list[int], max_tokens: int, stop: list[int]) -> list[int]:
    """The double's documented rule (tests/engine_double.py): token i = (last prompt id + 1 + i) % 50, cut after
    the first stop id."""
    out = []
    for i in range(max_tokens):
        out.append((prompt[-1] + 1 + i) % 50)
        if out[-1] in stop:
            break
    return out


def _gone(pids: set[int], within_s: float = 30.0) -> bool:
    """True once none of ``pids`` exists (an upper bound, not a race: the stop is already under way)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not any(Path(f"/proc/{p}").exists() and "zombie" not in _state(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "gone"


def test_start_request_response_and_stop_leave_nothing(fake_engine):
    server = fake_engine(child=True).start()
    pids = server.pids()
    assert len(pids) >= 3  # keeper, server, and the server's own child (which left its session)
    client = EngineClient(server.url, timeout_s=30)
    toks, wall = client.complete([3, 7], max_tokens=5, stop_ids=[])
    assert toks == [8, 9, 10, 11, 12] and wall > 0
    assert client.complete([3, 7], max_tokens=20, stop_ids=[10])[0] == [8, 9, 10]  # cut after the stop id
    prompts = [[1], [2, 40], [5, 6, 7], [48]]
    got = client.complete_many(prompts, max_tokens=4, stop_ids=[0])
    assert [g[0] for g in got] == [answer(p, 4, [0]) for p in prompts]
    assert all(g[1] > 0 for g in got)
    assert server.cpu_s() >= 0 and server.wait_quiet(limit_s=2.0) <= 2.5
    server.stop()
    assert _gone(pids) and port_free(server.port)


def test_ignore_eos_runs_past_the_model_s_own_eos(fake_engine):
    """Fixed work (harness/speed/scaling.py): with no stop id the server still stops at its model's EOS, unless
    the request sets ignore_eos."""
    server = fake_engine(eos=10).start()
    client = EngineClient(server.url, timeout_s=30)
    assert client.complete([3, 7], max_tokens=5, stop_ids=[])[0] == [8, 9, 10]
    assert client.complete([3, 7], max_tokens=5, stop_ids=[], ignore_eos=True)[0] == [8, 9, 10, 11, 12]
    assert [g[0] for g in client.complete_many([[7], [8]], 4, [], ignore_eos=True)] == [[8, 9, 10, 11],
                                                                                         [9, 10, 11, 12]]


def test_server_that_exits_before_it_is_ready_is_one_error_naming_its_log(fake_engine):
    server = fake_engine(mode="crash")
    with pytest.raises(EngineError) as e:
        server.start()
    assert "exited (code 3) before it was ready" in str(e.value) and str(server.log_path) in str(e.value)
    assert "\n" not in str(e.value) and port_free(server.port)


def test_server_that_never_answers_health_times_out_and_is_stopped(fake_engine):
    server = fake_engine(mode="never-healthy", child=True, health_timeout_s=1.0)
    with pytest.raises(EngineError) as e:
        server.start()
    assert "/health within 1 s" in str(e.value) and str(server.log_path) in str(e.value)
    assert server.proc is None and port_free(server.port)


def test_server_crash_while_serving_is_an_engine_error(fake_engine):
    server = fake_engine().start()
    pids = server.pids()
    with pytest.raises(EngineError, match="engine request"):
        EngineClient(server.url, timeout_s=30).complete([1, 999], max_tokens=3, stop_ids=[])
    # The keeper sees its server gone and ends; stop() after that is harmless.
    assert _gone(pids)
    server.stop()
    assert port_free(server.port)


HOLDER = textwrap.dedent("""
    import signal, sys, time
    from harness.run.engine import EngineServer
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as at a terminal (xdist workers ignore it)
    port = int(sys.argv[1])
    s = EngineServer([sys.executable, "tests/engine_double.py", "--port", str(port), "--child"], port,
                     sys.argv[2], health_timeout_s=60).start()
    print(" ".join(map(str, sorted(s.pids()))), flush=True)
    time.sleep(3600)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_harness_process_stopped_or_killed_takes_its_server_along(tmp_path, sig):
    """SIGTERM (Slurm preemption), Ctrl-C, and a kill -9 of the process that started the server: the keeper (its
    parent's death signal, its subreaper role) stops every process below it and the port is freed."""
    from harness.run.engine import free_port

    port = free_port()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), str(tmp_path / "engine.log")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = {int(p) for p in holder.stdout.readline().split()}
        assert len(pids) >= 3, pids
        holder.send_signal(sig)
        holder.wait(timeout=60)
        assert _gone(pids), [(p, _state(p)) for p in pids]
        assert port_free(port)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_descendants_follow_the_tree():
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        end = time.monotonic() + 30
        while len(descendants(p.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        tree = descendants(p.pid)
        assert p.pid in tree and len(tree) == 2 and os.getpid() not in tree
    finally:
        for pid in descendants(p.pid):
            os.kill(pid, signal.SIGKILL)
        p.wait()


# ---------------------------------------------------------------- naming and checking an engine row


def test_models_string_names_an_engine_row_with_its_knobs():
    ar, eng = parse_models("ar,q=checkpoints/tiny/ar:ar@vllm:max_num_seqs=4,gen_length=16,enforce_eager=false")
    assert (ar.decoder, ar.engine) == ("ar", None) and "engine" not in ar.to_dict()
    assert (eng.decoder, eng.engine, eng.label) == ("ar", "vllm", "ar@vllm")
    assert eng.knobs == {"max_num_seqs": 4, "gen_length": 16, "enforce_eager": False}
    spec, rest = split_knobs("vllm", eng.knobs)
    assert (spec.max_num_seqs, spec.enforce_eager, rest) == (4, False, {"gen_length": 16})
    assert split_decoder("ar") == ("ar", None)


@pytest.mark.parametrize("spec, words", [
    ("q=checkpoints/tiny/ar:ar@sglang", ["unknown engine 'sglang'", "valid engines: vllm"]),
    ("q=checkpoints/tiny/ar:refusion@vllm", ["serves the ar decoder only", "ar@vllm"]),
])
def test_a_bad_engine_names_the_valid_choices(spec, words):
    with pytest.raises(InputError) as e:
        parse_models(spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_engine_knobs_are_checked_by_type():
    with pytest.raises(EngineError, match="max_num_seqs='x': expected int"):
        split_knobs("vllm", {"max_num_seqs": "x"})
    with pytest.raises(EngineError, match="valid: float32, bfloat16, float16"):
        split_knobs("vllm", {"dtype": "int8"})


def test_models_file_takes_an_engine_decoder(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text('[[models]]\nname = "q"\npath = "ckpt"\ndecoder = "ar@vllm"\nknobs = { max_num_seqs = 2 }\n')
    (m,) = load_models_file(f)
    assert (m.decoder, m.engine, m.knobs) == ("ar", "vllm", {"max_num_seqs": 2})


def test_server_command_on_the_cpu_sets_a_kv_budget_not_a_memory_share():
    cmd = server_command(EngineSpec(), "/ckpt", 8123, "float32", "cpu")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(512 * 2**20)
    assert "--enforce-eager" in cmd and "--gpu-memory-utilization" not in cmd
    gpu = server_command(EngineSpec(gpu_memory_utilization=0.6, enforce_eager=False), "/c", 1, "bfloat16", "cuda")
    assert "--kv-cache-memory-bytes" not in gpu and "--enforce-eager" not in gpu
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.6"


def test_broken_engine_venv_is_one_line(tmp_path):
    with pytest.raises(EngineError, match="no venv at .*make setup-vllm"):
        check_engine(EngineSpec(venv=str(tmp_path / "none")))
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").symlink_to(sys.executable)  # a venv without vllm
    with pytest.raises(EngineError) as e:
        check_engine(EngineSpec(venv=str(tmp_path / "v")))
    assert "vllm does not import" in str(e.value) and "\n" not in str(e.value)


def test_eval_with_a_broken_engine_venv_stops_before_any_model_loads(tmp_path, one_error):
    p = subprocess.run([sys.executable, "-m", "harness", "eval", "--task", "embedded_math", "--limit", "1",
                        "--out", str(tmp_path / "runs"), "--models",
                        f"ar,q=checkpoints/tiny/ar:ar@vllm:venv={tmp_path / 'none'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    err = one_error(p.returncode, p.stderr)
    assert "model 'q': engine vllm: no venv at" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ---------------------------------------------------------------- speedups against each AR baseline, agreement


def _records(tps: dict[str, float], rounds: int = 4, calls: int = 3) -> list[dict]:
    """Timed-round records where side s decodes 10 tokens per call at tps[s] tokens/s in every round."""
    return [{"round": r, "group": "t", "side": s, "repeat": 1,
             "calls": [{"wall_s": 10 / v, "cpu_s": 10 / v, "tokens": 10, "rows": 1} for _ in range(calls)]}
            for r in range(rounds) for s, v in tps.items()]


def test_speedups_against_every_ar_baseline_name_it():
    from harness.run import speedups, summary

    cfg = {"baseline": "ar", "units": [{"name": "t"}],
           "models": [{"name": "ar", "decoder": "ar"}, {"name": "v", "decoder": "ar", "engine": {"name": "vllm"}},
                      {"name": "rf", "decoder": "refusion"}]}
    timed = {"passes": [{"sides": ["ar", "v", "rf"], "records": _records({"ar": 10.0, "v": 20.0, "rf": 30.0})}]}
    assert speedups.ar_baselines(cfg) == ["ar", "v"]
    got = speedups.all_speedups(timed, cfg)
    assert got["ar"]["rf"]["ratio"] == pytest.approx(3.0) and got["v"]["rf"]["ratio"] == pytest.approx(1.5)
    assert got["ar"]["v"]["per_task"]["t"]["ratio"] == pytest.approx(2.0)
    s = {"baseline": "ar", "speedups": got,
         "baseline_labels": {b: speedups.baseline_label(cfg, b) for b in speedups.ar_baselines(cfg)},
         "rows": [{"model": m, "task": "t"} for m in ("ar", "v", "rf")]}
    heads, cells = summary._other_baselines(s)
    assert heads == ["speedup vs v (vLLM, at client) [95% CI]"]
    assert cells[1] == ["1.00x (itself)"] and cells[2][0].startswith("1.50x")
    assert speedups.lines(s)[0].startswith("Mean per-task speedup vs v (vLLM, at client) [95% CI]: ar 0.50x")


def test_agreement_finds_the_first_difference_and_its_margin(tmp_path):
    """Two rows' sample logs that differ on one item: its first differing position, and the transformers
    model's top-2 margin there, read from the tiny AR checkpoint."""
    import json

    from harness.run import agreement

    assert agreement.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.first_difference([1, 2], [1, 2, 3]) == 2
    ckpt = str(REPO / "checkpoints" / "tiny" / "ar")
    for name, second in (("ar", [7, 8, 9]), ("v", [7, 4, 9])):
        d = tmp_path / "models" / name / "samples"
        d.mkdir(parents=True)
        rows = [{"task": "t", "doc_id": 0, "prompt": "2+2=", "tokens": [5, 6]},
                {"task": "t", "doc_id": 1, "prompt": "3+4=", "tokens": second}]
        (d / "u.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"baseline": "ar", "dtype": "float32", "device": "cpu", "units": [{"name": "u"}],
           "models": [{"name": "ar", "decoder": "ar", "checkpoint": ckpt},
                      {"name": "v", "decoder": "ar", "checkpoint": ckpt, "engine": {"name": "vllm"}}]}
    got = agreement.check(tmp_path, cfg)
    (p,) = got["pairs"]
    assert (p["items"], p["equal"], p["share"]) == (2, 1, 0.5) and not p["ok"]  # 50% < 95%
    (d,) = p["differences"]
    assert (d["doc_id"], d["position"], d["engine_token"], d["ar_token"]) == (1, 1, 4, 8)
    assert d["margin"] >= 0 and d["near_tie"] == (d["margin"] < 0.01)
    line = agreement.lines(got)[0]
    assert line.startswith("Agreement v vs ar: 1/2 items") and "t document 1 at token 1 (margin" in line
