"""`python -m harness bench-e2e` (scripts/gpu_check.sh's end-to-end timing) on the CPU at the tiny shape: it
writes its JSON with one entry per configuration, a kernel this machine lacks is recorded as skipped, and
the forward counts per call kind add up to the decoders' NFE (the tokens/s pass and the hooked pass decode
the same prompts the same way)."""

import json

import pytest


def test_bench_e2e_tiny_shape_writes_results(tmp_path, capsys):
    from harness.speed import bench_e2e

    out = tmp_path / "gpu_check.json"
    out.write_text(json.dumps({"kept": 1}))  # other sections of the file survive
    rc = bench_e2e.main(["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--prompts", "2",
                         "--prompt-len", "24", "--gen-length", "8", "--slot-size", "4",
                         "--configs", "ar,refusion_sdpa,refusion_triton", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["kept"] == 1 and doc["e2e"]["shape"] == "tiny"
    res = doc["e2e"]["results"]
    assert "skipped" in res["refusion_triton"]  # no CUDA here: one line, not a crash
    for name in ("ar", "refusion_sdpa"):
        r = res[name]
        assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0
        assert sum(v["calls"] for v in r["forward_ms"].values()) == r["nfe"], r
    assert set(res["ar"]["forward_ms"]) == {"prefill", "one"}
    assert res["ar"]["forward_ms"]["prefill"]["calls"] == 2  # one prefill per prompt


@pytest.mark.parametrize("argv, msg", [(["--configs", "nope"], "unknown config"),
                                       (["--prompts", "0"], "must be >= 1")])
def test_bench_e2e_bad_input_is_one_line(argv, msg, capsys):
    from harness.speed import bench_e2e

    assert bench_e2e.main(["--device", "cpu", "--shape", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and msg in err and len(err.splitlines()) == 1
