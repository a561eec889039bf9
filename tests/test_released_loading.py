"""The released layouts (tests/fixtures/released/, made from the authors' own code by
scripts/make_release_fixtures.py) through the path `make eval` uses: harness.models.checkpoints.load_model
gives the authors' logits, the decoders give the authors' greedy tokens, and a run over every
family writes its metrics.

Which of the authors' generations have a decoder equivalent (the rest is listed in
docs/models.md and skipped here by name):
- LLaDA `generate` -> `llada`; Fast-dLLM's `generate` / `generate_with_prefix_cache` /
  `generate_with_dual_cache` with a threshold -> `fast_dllm` cache none / prefix / dual (the
  threshold-free runs use a fixed step schedule that `fast_dllm` has no knob for);
- Dream `diffusion_generate` with steps and a deterministic alg -> `dream` (its `origin` alg draws
  random numbers in the authors' order, and the default run uses `origin`);
- Fast-dLLM's Dream block loop with `alg=confidence_threshold` -> `fast_dllm` (shift from the family);
- D2F's `_generate_block_single` -> `d2f` (shift from the family for Dream);
- ReFusion `generate_refusion` -> `refusion`; Llama-3 greedy `generate` -> `ar`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent / "fixtures" / "released"
FOLDERS = {"refusion": None, "llada": None, "dream_instruct": None, "dream_base": None,
           "d2f_llada": "llada", "d2f_dream": "dream_base", "llama3": None, "qwen3": None}  # folder -> base of an adapter
FAMILY = {"refusion": "refusion", "llada": "llada", "dream_instruct": "dream", "dream_base": "dream",
          "d2f_llada": "llada", "d2f_dream": "dream", "llama3": "llama", "qwen3": "qwen3"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _ref(name: str) -> dict:
    return json.loads((ROOT / name / "reference.json").read_text())


@pytest.fixture(scope="module")
def loaded():
    from harness.models.checkpoints import load_model

    cache: dict = {}

    def get(name: str):
        if name not in cache:
            base = FOLDERS[name]
            cache[name] = load_model(ROOT / name, base=ROOT / base if base else None)
        return cache[name]

    return get


def _decoder_call(generator: str, kw: dict) -> tuple[str, dict] | None:
    """The decoder and knobs that reproduce one of the authors' generator calls, or None (no equivalent)."""
    if generator == "llada.generate":
        return "llada", dict(gen_length=kw["gen_length"], steps=kw["steps"], block_length=kw["block_length"],
                             remasking=kw["remasking"])
    if generator.startswith("fast_dllm.llada."):
        if kw.get("threshold") is None:
            return None
        cache = {"generate": "none", "generate_with_prefix_cache": "prefix",
                 "generate_with_dual_cache": "dual"}[generator.rsplit(".", 1)[1]]
        return "fast_dllm", dict(gen_length=kw["gen_length"], block_length=kw["block_length"],
                                 threshold=kw["threshold"], cache=cache)
    if generator == "dream.diffusion_generate":
        if "steps" not in kw or kw.get("alg") in (None, "origin"):
            return None
        return "dream", dict(gen_length=kw["max_new_tokens"], steps=kw["steps"], alg=kw["alg"],
                             alg_temp=kw["alg_temp"] or 0.0, eps=kw["eps"])
    if generator == "fast_dllm.dream.diffusion_generate(generation_utils_block)":
        if kw.get("alg") != "confidence_threshold":
            return None
        return "fast_dllm", dict(gen_length=kw["max_new_tokens"], block_length=kw["block_length"],
                                 threshold=kw["threshold"], cache="dual" if kw["dual_cache"] else "prefix")
    if generator.startswith("d2f."):
        return "d2f", dict(gen_length=kw["max_new_tokens"], block_size=kw["block_size"],
                           block_add_threshold=kw["block_add_threshold"],
                           decoded_token_threshold=kw["decoded_token_threshold"], skip_threshold=kw["skip_threshold"])
    if generator == "refusion.generate_refusion":
        return "refusion", {k: kw[k] for k in ("gen_length", "slot_size", "serial_num_blocks", "slot_threshold",
                                               "token_threshold")}
    if generator in ("transformers.LlamaForCausalLM.generate", "transformers.Qwen3ForCausalLM.generate"):
        return "ar", dict(gen_length=kw["max_new_tokens"])
    return None


@pytest.mark.reference
@pytest.mark.parametrize("name", list(FOLDERS))
def test_loader_recognises_the_family_and_gives_the_authors_logits(name, loaded, assert_close):
    from safetensors.torch import load_file

    m = loaded(name)
    assert m.family.name == FAMILY[name]
    assert type(m.model).__name__ == m.family.model_class
    assert m.model.config.is_causal is (name in ("refusion", "llama3", "qwen3"))
    ref = _ref(name)["logits"]
    want = load_file(str(ROOT / name / "reference.safetensors"))[ref.get("key_merged") or ref["key"]]
    with torch.no_grad():
        got = m.model(torch.tensor(ref["input_ids"])).logits
    assert_close(got, want)  # float32, the authors' modelling code vs stock transformers classes
    # The ids the decoders get: the released mask token, and EOS ids that include the config's.
    if name not in ("llama3", "qwen3"):
        mask_text = {"llada": "<|mdm_mask|>"}.get(FAMILY[name], "<|mask|>")
        assert m.mask_id == m.tokenizer.convert_tokens_to_ids(mask_text)
    cfg_eos = json.loads((ROOT / (FOLDERS[name] or name) / "config.json").read_text()).get("eos_token_id")
    assert cfg_eos is None or cfg_eos in m.eos_ids


@pytest.mark.reference
@pytest.mark.parametrize("name", list(FOLDERS))
def test_decoders_give_the_authors_greedy_tokens(name, loaded):
    from harness.run.lm_adapter import checkpoint_knobs
    from refusion.decoding import DECODERS

    m = loaded(name)
    checked, skipped = 0, set()
    for g in _ref(name)["generations"]:
        call = _decoder_call(g["generator"], g["kwargs"])
        if call is None:
            skipped.add(g["generator"])
            continue
        decoder, knobs = call
        own = {k: v for k, v in checkpoint_knobs(m.info, decoder).items() if k == "shift"}  # the family's shift
        tokens, stats = DECODERS[decoder](m.model, torch.tensor([g["prompt_ids"]]), mask_token_id=m.mask_id,
                                          eos_token_id=list(m.eos_ids), **own, **knobs)
        got, want = tokens[0].tolist(), g["output_ids"]
        assert got == want[: len(got)], (g["generator"], g["kwargs"], got, want)
        # A shorter answer only when it ends in EOS (the decoders cut there; the authors pad with it).
        assert len(got) == len(want) or got[-1] in m.eos_ids, (g["generator"], got, want)
        checked += 1
    assert checked >= 3, (name, skipped)
    assert skipped <= {"fast_dllm.llada.generate", "fast_dllm.llada.generate_with_prefix_cache",
                       "fast_dllm.llada.generate_with_dual_cache", "dream.diffusion_generate",
                       "fast_dllm.dream.diffusion_generate(generation_utils)",
                       "fast_dllm.dream.diffusion_generate(generation_utils_block)"}, skipped


@pytest.mark.slow
def test_make_eval_path_runs_every_family_and_writes_metrics(write_task, tmp_path):
    """`harness eval` (the runner `make eval` calls) on the released layouts, 2 items each: every folder loads
    (the adapters' bases llada/ and dream_base/ with them), an adapter with its base, a Dream-family shift
    from the family table; the tiny task is not in the task table, so gen_length is given as a knob.
    (llada and dream decode through the same loader in the token tests above.)"""
    from harness.run import runner

    tasks = write_task(tmp_path / "tasks", "tiny_gen", n=2)
    models = ",".join([
        f"refusion={ROOT}/refusion:refusion:gen_length=8,slot_size=4",
        f"dream_fast_dllm={ROOT}/dream_instruct:fast_dllm:gen_length=8,block_length=8",
        f"d2f_llada={ROOT}/d2f_llada:d2f:gen_length=8,block_size=4,base={ROOT}/llada",
        f"d2f_dream={ROOT}/d2f_dream:d2f:gen_length=8,block_size=4,base={ROOT}/dream_base",
        f"llama3={ROOT}/llama3:ar:gen_length=8"])
    out = tmp_path / "out"
    assert runner.main(["--task", "tiny_gen", "--tasks-dir", str(tasks), "--models", models, "--out", str(out),
                        "--run-id", "r", "--threads", "1"]) == 0
    run = json.loads((out / "r" / "run.json").read_text())
    by_name = {m["name"]: m for m in run["models"]}
    assert by_name["d2f_llada"]["family"] == "llada" and by_name["d2f_llada"]["base"].endswith("llada")
    assert by_name["dream_fast_dllm"]["resolved_knobs"]["tiny_gen"]["shift"] is True  # Dream's logit shift
    assert by_name["d2f_dream"]["resolved_knobs"]["tiny_gen"]["shift"] is True
    for name in by_name:
        metrics = json.loads((out / "r" / "metrics" / f"{name}__tiny_gen.json").read_text())
        assert metrics["requests"]["generate"] == 2, name


@pytest.mark.slow
def test_nine_table1_rows_in_one_run_fill_every_published_claim(tmp_path, monkeypatch):
    """README's Table 1 recipe in one run on the released layouts (the tiny committed `ar` stands in for
    Qwen3-8B, a Qwen3 checkpoint; gen_length 32 and one GSM8K item instead of 512 and the test set): Qwen3 and
    ReFusion get enable_thinking=false as their own setting, and speedup.md has our value beside every one
    of the paper's speedup claims."""
    import re

    from harness.report import paper_report
    from harness.run import runner

    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(json.dumps({"question": "Tom has 3 apples and buys 4 more. How many?",
                                                 "answer": "3 + 4 = 7\n#### 7"}) + "\n")
    monkeypatch.setenv("REFUSION_DATA_DIR", str(tmp_path / "data"))
    repo = ROOT.parents[2]
    g, fast = "gen_length=32", "block_length=32,threshold=0.9,cache=dual,gen_length=32"
    models = ",".join([
        f"llama3={ROOT}/llama3:ar:{g}", f"qwen3={repo}/checkpoints/tiny/ar:ar:{g},chat_template_args=enable_thinking=false",
        f"llada={ROOT}/llada:llada:block_length=32,{g}", f"llada_fast_dllm={ROOT}/llada:fast_dllm:{fast}",
        f"llada_d2f={ROOT}/d2f_llada:d2f:{g},base={ROOT}/llada", f"dream={ROOT}/dream_instruct:dream:alg=entropy,{g},steps=32",
        f"dream_fast_dllm={ROOT}/dream_instruct:fast_dllm:{fast}", f"dream_d2f={ROOT}/d2f_dream:d2f:{g},base={ROOT}/dream_base",
        f"refusion={ROOT}/refusion:refusion:gen_length=128,chat_template_args=enable_thinking=false"])
    out = tmp_path / "out"
    assert runner.main(["--task", "gsm8k_cot", "--limit", "1", "--models", models, "--out", str(out), "--run-id", "t1",
                        "--threads", "1", "--baseline", "qwen3"]) == 0
    for name in ("qwen3", "refusion", "llama3"):
        met = json.loads((out / "t1" / "metrics" / f"{name}__gsm8k_cot.json").read_text())
        assert met["run"]["chat_template_args"] == ({} if name == "llama3" else {"enable_thinking": False})
    assert paper_report.main(["--run", str(out / "t1"), "--out", str(tmp_path / "reports"), "--name", "t"]) == 0
    sp = (tmp_path / "reports" / "t" / "speedup.md").read_text()
    rows = [ln for ln in sp.split("### The paper's speedup claims beside ours")[1].split("\n\n")[2].splitlines()[2:]]
    assert len(rows) == 8, rows
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert re.fullmatch(r"\d+\.\d\d", cells[2]) and re.fullmatch(r"\d+\.\d\d", cells[4]), ln
        assert cells[5] == "1" and cells[6].startswith("refusion / "), ln


# The folders beyond Table 1 ship sharded weights (an index and two shards), as their releases do.
SHARDED = [("diffusiongemma", "diffusion_gemma"), ("sdar", "sdar"), ("sdar_moe", "sdar"), ("llada2", "llada2")]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "tokenizer.model")


@pytest.mark.parametrize("folder,decoder", SHARDED, ids=[f for f, _ in SHARDED])
def test_dry_run_truncated_shard_and_missing_tokenizer_are_one_error_line(folder, decoder, tmp_path, dry_run,
                                                                           one_error):
    """The dry run of a copy whose last shard lost its last 100 bytes, and of a copy without its tokenizer
    files: one `error:` line (exit 2) naming the shard, or the folder."""
    import os
    import shutil

    cut = shutil.copytree(ROOT / folder, tmp_path / "cut")
    last = sorted(cut.glob("model-*-of-*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size - 100)
    rc, _, err = dry_run(f"m={cut}:{decoder}")
    assert str(last) in one_error(rc, err) and "truncated" in err, err
    bare = shutil.copytree(ROOT / folder, tmp_path / "bare")
    gone = [bare / n for n in TOKENIZER_FILES if (bare / n).is_file()]
    assert gone
    for path in gone:
        path.unlink()
    rc, _, err = dry_run(f"m={bare}:{decoder}")
    assert "has no tokenizer files" in one_error(rc, err) and str(bare) in err, err
