"""`python -m harness bench-compile` (scripts/gpu_check.sh's eager-vs-compiled stage) on the CPU at the tiny shapes:
every decoder of the stage decodes the same prompts eagerly and compiled, with the same tokens and NFE, its
compilations recorded, one line printed per decoder and the JSON merged into the given file; the time budget
skips what is left. dynamo's ``aot_eager`` backend (plain ``eager`` for the budget check) keeps it quick here:
the same tracing and static shapes without inductor's C++ build (tests/test_compiled.py runs inductor)."""

import json

import pytest


# make test compiles ar and fast_dllm here (the decoders test_compiled.py leaves to make test-slow); the
# four-decoder run is the slow one (57 s of aot_eager compiles): refusion and llada / d2f are compiled in
# make test by test_compiled.py's one-prompt checks.
@pytest.mark.parametrize("decoders", ["ar,fast_dllm", pytest.param("all", marks=pytest.mark.slow)])
def test_bench_compile_tiny_shapes(decoders, tmp_path, capsys):
    from harness.speed import bench_compile

    names = list(bench_compile.DECODERS) if decoders == "all" else decoders.split(",")
    out = tmp_path / "gpu_check.json"
    out.write_text(json.dumps({"e2e": {"kept": 1}}))  # the other stages' sections survive
    rc = bench_compile.main(["--device", "cpu", "--tiny", "--prompts", "2", "--prompt-len", "12", "--gen-length", "8",
                             "--slot-size", "4", "--backend", "aot_eager", "--out", str(out),
                             "--decoders", ",".join(names)])
    text = capsys.readouterr()
    assert rc == 0, text.err
    doc = json.loads(out.read_text())
    assert doc["e2e"] == {"kept": 1} and doc["compile"]["device"] == "cpu"
    res = doc["compile"]["results"]
    assert set(res) == set(names)
    for name, r in res.items():
        assert r["tokens_equal"] and r["prompts_equal"] == 2, (name, r)
        assert r["nfe"]["eager"] == r["nfe"]["compiled"] > 0 and r["tpf"]["eager"] == r["tpf"]["compiled"]
        assert r["compilations_after_warmup"] == 0  # prompts of one length: the warm-up compiled every bucket
        assert r["tokens_per_s"]["eager"] > 0 and r["tokens_per_s"]["compiled"] > 0
        assert r["shape"].endswith("-tiny") and r["layers"] == 2
    assert res["ar"]["compilations"] >= 1  # a fresh model: its graphs compiled in the warm-up
    lines = [x for x in text.out.splitlines() if x.startswith("compile ")]
    assert len(lines) == len(names) and all("tokens equal" in x for x in lines), text.out


def test_bench_compile_budget_skips_and_bad_input(tmp_path, capsys):
    from harness.speed import bench_compile

    out = tmp_path / "g.json"
    rc = bench_compile.main(["--device", "cpu", "--tiny", "--decoders", "llada,ar", "--prompts", "1",
                             "--prompt-len", "4", "--gen-length", "4", "--backend", "eager",
                             "--budget-s", "1e-9", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["compile"]["results"]
    assert "tokens_equal" in res["llada"] and "time budget" in res["ar"]["skipped"]
    assert "compile ar: skipped" in capsys.readouterr().out
    assert bench_compile.main(["--device", "cpu", "--decoders", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "unknown decoder" in err and len(err.splitlines()) == 1
