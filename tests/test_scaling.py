"""`python -m harness scaling` (harness/speed/scaling.py): one --quick run on the tiny checkpoints (module
fixture), read back for its structure, its fits (against numpy), memory linear in batch and one point
re-decoded; budget parsing and the budget rule; resume after an interruption; one-line errors; the make target.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.speed import scaling

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick(shared_once):
    """(result, out path, report folder) of `scaling --quick` with the default decoders (made once per session,
    by whichever xdist worker runs these tests first; read-only to the tests)."""
    import torch

    def make(tmp: Path) -> None:
        threads = torch.get_num_threads()
        try:
            # the decoders named: a machine with .venv-vllm would add the engine row to the default ones
            assert scaling.main(["--quick", "--decoders", ",".join(scaling.DEFAULT_DECODERS),
                                 "--out", str(tmp / "scaling.json"), "--report", str(tmp / "report")]) == 0
        finally:
            torch.set_num_threads(threads)

    tmp = shared_once("scaling-quick", make)
    out, report = tmp / "scaling.json", tmp / "report"
    return json.loads(out.read_text()), out, report


def test_the_json_holds_every_point_with_what_reproduces_it(quick):
    result, out, report = quick
    s = result["settings"]
    assert s["decoders"] == list(scaling.DEFAULT_DECODERS) and s["quick"] and s["eos_token_id"] == -1
    expected = [(p["sweep"], p["x"], d) for p in scaling.plan(s) for d in s["decoders"]]
    assert [(p["sweep"], p["x"], p["decoder"]) for p in result["points"]] == expected
    for p in result["points"]:
        assert p["generated_tokens"] == p["batch"] * p["gen_length"]  # the work is fixed: no early EOS
        assert p["tpf"] == pytest.approx(p["generated_tokens"] / p["nfe"])
        assert p["knobs"]["gen_length"] == p["gen_length"] and p["special_ids"]["eos_token_id"] == -1
        if p["decoder"] in ("llada", "fast_dllm"):
            assert p["knobs"]["stop_at_eos"] is False and p["knobs"]["block_length"] == 8  # QUICK_KNOBS
        assert p["checkpoint"].startswith("checkpoints/tiny/") and (REPO / p["checkpoint"]).is_dir()
        assert len(p["prompts"]) == p["batch"]
        assert all(len(result["prompts"][k]) == p["prompt_length"] for k in p["prompts"])
        m = p["memory"]
        assert m["peak_bytes"] == sum(m["breakdown"][k] for k in ("kv_cache", "logits", "other")) > 0
        assert m["weights_bytes"] > 0
        assert p["timing"]["latency_s"] > 0 and p["timing"]["rounds"] == 1
        assert p["timing"]["tokens_per_s"] == pytest.approx(p["generated_tokens"] / p["timing"]["latency_s"])
    assert set(result["budget"]["decoders"]) == set(s["decoders"])
    assert out.stat().st_size < 2 * 2**20
    names = {p.name for p in report.iterdir()}
    assert {"index.md", "latency_gen.png", "memory_gen.png", "latency_prompt.png", "memory_prompt.png",
            "latency_batch.png", "memory_batch.png", "throughput_batch.png"} <= names
    index = (report / "index.md").read_text()
    assert "## Log-log slopes" in index and "## Largest batch under the memory budget" in index
    assert not list(out.parent.glob(".scaling.*.partial.json"))  # removed once the result is written


def test_prompts_are_the_recipe_s_chat_prompts(quick):
    """The stored ids are what chat_prompt_ids gives (the recipe regenerates them), each ending with the
    generation prompt, rows of a batch distinct."""
    from harness.models.checkpoints import load_tokenizer, inspect_checkpoint

    result = quick[0]
    tok = load_tokenizer(inspect_checkpoint(REPO / "checkpoints" / "tiny" / "ar"))
    tail = tok(tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"][-2:]
    for key, ids in result["prompts"].items():
        length, row = map(int, key.split("/"))
        assert ids == scaling.chat_prompt_ids(tok, length, row) and len(ids) == length
        assert ids[-2:] == tail
    assert result["prompts"]["8/0"] != result["prompts"]["8/1"]
    long = scaling.chat_prompt_ids(tok, 700, 0)
    assert len(long) == 700 and long[-8:] == scaling.chat_prompt_ids(tok, 8, 0)


def test_slopes_are_least_squares_in_log_log(quick):
    result = quick[0]
    for d, per in result["fits"].items():
        for sweep in scaling.SWEEPS:
            pts = [p for p in result["points"] if p["decoder"] == d and p["sweep"] == sweep]
            x = np.log([p["x"] for p in pts])
            for what, y in (("latency_s", [p["timing"]["latency_s"] for p in pts]),
                            ("peak_bytes", [p["memory"]["peak_bytes"] for p in pts]),
                            ("nfe", [p["nfe"] for p in pts])):
                slope, intercept = np.polyfit(x, np.log(y), 1)
                assert per[sweep][what]["slope"] == pytest.approx(slope, rel=1e-9, abs=1e-12), (d, sweep, what)
                assert per[sweep][what]["intercept"] == pytest.approx(intercept, rel=1e-9, abs=1e-12)


def test_fits_against_numpy_on_known_data():
    xs = [1, 2, 4, 8]
    assert scaling.loglog_fit(xs, [3 * x**2 for x in xs])["slope"] == pytest.approx(2.0)
    ys = [5.0, 7.5, 11.0, 19.0]
    fit = scaling.linear_fit(xs, ys)
    slope, intercept = np.polyfit(xs, ys, 1)
    assert (fit["slope"], fit["intercept"]) == pytest.approx((slope, intercept))
    assert fit["r2"] == pytest.approx(np.corrcoef(xs, ys)[0, 1] ** 2)
    assert scaling.loglog_fit([4], [1.0]) is None and scaling.loglog_fit([1, 2], [0.0, 1.0]) is None


def test_peak_memory_is_linear_in_batch(quick):
    result = quick[0]
    for d in result["settings"]["decoders"]:
        pts = [p for p in result["points"] if p["decoder"] == d and p["sweep"] == "batch"]
        b = [p["batch"] for p in pts]
        m = [p["memory"]["peak_bytes"] for p in pts]
        assert len(b) >= 3 and np.corrcoef(b, m)[0, 1] ** 2 >= 0.99, (d, b, m)
        assert result["fits"][d]["batch"]["memory_linear"]["r2"] == pytest.approx(np.corrcoef(b, m)[0, 1] ** 2)


def test_the_budget_batch_is_the_largest_that_fits(quick):
    result = quick[0]
    budget = result["budget"]["budget_bytes"]
    assert budget == 2**30
    for d, row in result["budget"]["decoders"].items():
        fit, w, big = row["fit"], row["weights_bytes"], row["largest_batch"]
        assert fit["intercept"] + fit["slope"] * big + w <= budget < fit["intercept"] + fit["slope"] * (big + 1) + w
        assert row["measured_batch"] == min(big, result["settings"]["budget_max_batch"])
        assert row["measured_tokens_per_s"] > 0
        assert row["throughput"].startswith(("measured", "extrapolated"))
    assert scaling.budget_batch({"slope": 10.0, "intercept": 5.0}, 100, 1000) == 89
    assert scaling.budget_batch({"slope": 10.0, "intercept": 5.0}, 1000, 1000) == 0
    assert scaling.budget_batch({"slope": 0.0, "intercept": 5.0}, 1, 1000) is None


def test_one_point_decodes_again_to_the_same_counts_and_bytes(quick, one_thread):
    """The record alone (checkpoint, decoder, knobs, special ids, prompt ids, batch) gives the same NFE, TPF,
    tokens and peak memory through the registry's decoder: the batch-2 point of every decoder."""
    import torch

    from harness.models.checkpoints import load_model
    from harness.run.memory import DecodeMemory
    from refusion.decoding import DECODERS

    result = quick[0]
    for p in [p for p in result["points"] if (p["sweep"], p["x"]) == ("batch", 2)]:
        lm = load_model(REPO / p["checkpoint"])
        ids = torch.tensor([result["prompts"][k] for k in p["prompts"]])
        scaling.clear_decoder_memos()
        with DecodeMemory(lm.model) as mem:
            tokens, stats = DECODERS[p["decoder_fn"]](lm.model, ids, None, p["knobs"], **p["special_ids"])
        got = mem.result()
        assert (stats["nfe"], stats["tpf"], stats["generated_tokens"]) == (p["nfe"], p["tpf"], p["generated_tokens"])
        assert got["peak_bytes"] == p["memory"]["peak_bytes"] and got["breakdown"] == p["memory"]["breakdown"]


@pytest.mark.parametrize("text, expected", [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("1073741824", 2**30),
                                            ("1.5 gib", 3 * 2**29), ("2GB", 2 * 10**9), ("64kib", 65536)])
def test_budget_strings(text, expected):
    assert scaling.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "1 GiBs", "-1GiB", "0", "1e9", "GiB"])
def test_bad_budget_strings_are_refused(text):
    with pytest.raises(scaling.InputError, match="--memory-budget"):
        scaling.parse_bytes(text)


@pytest.mark.parametrize("argv, message", [
    (["--decoders", "ar,nope"], "error: unknown decoder 'nope'; valid decoders: ar, refusion,"),
    (["--decoders", "refusion@vllm"], "error: decoder 'refusion@vllm': an engine serves an AR preset only"),
    (["--decoders", "ar@tgi"], "error: decoder 'ar@tgi': an engine serves an AR preset only, and the engines are "
                               "vllm"),
    (["--memory-budget", "lots"], "error: --memory-budget: cannot read 'lots'"),
    (["--gen-lengths", "64,32"], "error: --gen-lengths: give at least two distinct positive integers"),
    (["--rounds", "0"], "error: --rounds must be >= 1"),
])
def test_bad_input_is_one_error_line(argv, message, capsys, tmp_path):
    assert scaling.main([*argv, "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not list(tmp_path.iterdir())


def test_a_length_beyond_the_context_is_refused_before_decoding(capsys, tmp_path):
    assert scaling.main(["--quick", "--decoders", "ar", "--prompt-lengths", "8,1020", "--out",
                         str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ar: prompt 1020 + generation 8 tokens exceed the model's context of 1024 "
                          "positions") and err.count("\n") == 1, err


def test_an_interrupted_run_resumes_without_recomputing_finished_points(tmp_path, monkeypatch):
    import torch

    threads = torch.get_num_threads()
    argv = ["--quick", "--decoders", "ar", "--gen-lengths", "8,16", "--prompt-lengths", "8,16", "--batches", "1,2",
            "--out", str(tmp_path / "s.json"), "--report", ""]
    original, calls = scaling.Scaling.run_group, []

    def stop_after_one(self, size, pending, rounds):
        if calls:
            raise KeyboardInterrupt
        calls.append((size["sweep"], size["x"]))
        return original(self, size, pending, rounds)

    monkeypatch.setattr(scaling.Scaling, "run_group", stop_after_one)
    try:
        with pytest.raises(KeyboardInterrupt):
            scaling.main(argv)
        (partial,) = tmp_path.glob(".s.*.partial.json")
        first = json.loads(partial.read_text())["points"]
        assert list(first) == ["gen/8/ar"]

        seen = []

        def spy(self, size, pending, rounds):
            seen.append((size["sweep"], size["x"]))
            return original(self, size, pending, rounds)

        monkeypatch.setattr(scaling.Scaling, "run_group", spy)
        assert scaling.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert seen == [("gen", 16), ("prompt", 8), ("prompt", 16), ("batch", 1), ("batch", 2)]
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["points"][0] == first["gen/8/ar"] and result["resumed"] is True
    assert not list(tmp_path.glob(".s.*.partial.json"))


def test_an_engine_row_is_timed_beside_the_others_on_the_same_fixed_work(tmp_path, monkeypatch, capsys):
    """ar@vllm through the real EngineDecoder, server lifecycle and client, with the engine's test double as the
    server (tests/engine_double.py). The double has its own EOS at the first token it answers to every chat
    prompt, so only ignore_eos gives the fixed work (a shorter answer fails the run)."""
    import torch

    from harness.models.checkpoints import load_model
    from harness.run import engine, engine_decoder

    tok = load_model(str(REPO / "checkpoints" / "tiny" / "ar")).tokenizer
    eos = (scaling.chat_prompt_ids(tok, 8, 0)[-1] + 1) % 50  # the double's first answer token to these prompts
    started = []

    def command(spec, folder, port, dtype, device):
        started.append((spec, port))
        return [sys.executable, str(REPO / "tests" / "engine_double.py"), "--port", str(port), "--eos", str(eos)]

    monkeypatch.setattr(engine_decoder, "server_command", command)
    monkeypatch.setattr(engine_decoder, "check_engine", lambda spec: {"vllm": "double"})
    monkeypatch.setattr(engine, "check_engine", lambda spec: {"vllm": "double"})
    threads = torch.get_num_threads()
    try:
        assert scaling.main(["--quick", "--decoders", "ar,ar@vllm", "--gen-lengths", "8,16", "--prompt-lengths",
                             "8,16", "--batches", "1,2", "--out", str(tmp_path / "s.json"),
                             "--report", str(tmp_path / "report")]) == 0
    finally:
        torch.set_num_threads(threads)
    (spec, port), = started  # one server for the whole run, stopped at its end
    assert spec.max_num_seqs >= 2 and engine.port_free(port)
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["settings"]["engines"]["ar@vllm"]["max_num_seqs"] == spec.max_num_seqs
    assert result["engines"]["ar@vllm"]["versions"] == {"vllm": "double"}
    rows = [p for p in result["points"] if p["decoder"] == "ar@vllm"]
    assert len(rows) == len(result["points"]) // 2 == 6
    for p in rows:
        assert p["generated_tokens"] == p["batch"] * p["gen_length"] and p["nfe"] == p["gen_length"]
        assert p["memory"]["peak_bytes"] is None and p["memory"]["method"] == scaling.ENGINE_MEMORY
        t = p["timing"]
        assert t["latency_at"] == "client" and t["cpu_tokens_per_s"] is None and t["quiet_wait_s"] > 0
        assert t["tokens_per_s"] == pytest.approx(p["generated_tokens"] / t["latency_s"])
    fits = result["fits"]["ar@vllm"]
    assert fits["batch"]["latency_s"] is not None and fits["batch"]["peak_bytes"] is None
    assert result["budget"]["decoders"]["ar@vllm"]["throughput"].startswith("no budget row: memory not tracked")
    index = (tmp_path / "report" / "index.md").read_text()
    assert "| ar@vllm | 2 |" in index and "(at client)" in index
    assert "ar@vllm" in capsys.readouterr().out


def test_a_broken_engine_venv_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    from harness.models import checkpoints

    monkeypatch.setattr(checkpoints, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    assert scaling.main(["--quick", "--decoders", "ar,ar@vllm", "--engine-venv", str(tmp_path / "none"),
                         "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ar@vllm: engine vllm: no venv at ") and "make setup-vllm" in err, err
    assert err.count("\n") == 1


def test_the_default_decoders_add_the_engine_row_where_its_venv_exists(tmp_path):
    assert scaling.default_decoders(str(tmp_path)) == scaling.DEFAULT_DECODERS
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert scaling.default_decoders(str(tmp_path)) == (*scaling.DEFAULT_DECODERS, "ar@vllm")


def test_make_scaling_reaches_the_command(fake_venv):
    p = subprocess.run(["make", "-s", "scaling", f"VENV={fake_venv}", "SCALING_ARGS=--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("usage: python -m harness scaling "), p.stdout[:300]
