"""The lm-eval adapter `refusion_bench`: request round trips through lm-eval itself, knobs, journal.

Checkpoints here are built on the spot (conftest's `make_checkpoint`: random tiny Qwen3 + a
byte-level BPE with a chat template) so the tests do not depend on trained weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def ckpt(make_checkpoint, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "ar")


@pytest.fixture(scope="module")
def mdm_ckpt(make_checkpoint, tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "mdm", causal=False)


def _evaluate(lm, task_dir: Path, task: str, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, bootstrap_iters=0, **kw)


def test_generate_round_trip_matches_decoder_directly(ckpt, write_task, tmp_path):
    """lm-eval -> adapter -> decoder: the text lm-eval records is the decoder's tokens, chat-templated prompt in."""
    from harness.run.lm_adapter import RefusionBenchLM
    from refusion.decoding import DECODERS

    lm = RefusionBenchLM(pretrained=str(ckpt), decoder="ar", journal_dir=str(tmp_path / "j"))
    res = _evaluate(lm, write_task(tmp_path / "tasks"), "tiny_gen", apply_chat_template=True, log_samples=True)
    samples = res["samples"]["tiny_gen"]
    assert len(samples) == 4 and "exact_match,none" in res["results"]["tiny_gen"]
    recs = {r["doc_id"]: r for r in lm.journal.load().values()}
    assert len(recs) == 4 and lm.computed == 4
    for s in samples:
        prompt = s["arguments"][0][0]
        assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
        ids = lm.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        toks, stats = DECODERS["ar"](lm.model, ids, gen_length=6)
        rec = recs[s["doc_id"]]
        assert rec["tokens"] == toks[0].tolist()
        assert rec["nfe"] == stats["nfe"] and rec["generated_tokens"] == stats["generated_tokens"]
        text = lm.tokenizer.decode([t for t in rec["tokens"] if t != lm.tokenizer.eos_token_id],
                                   skip_special_tokens=True).split(".")[0]
        assert s["resps"][0][0] == text == rec["response"]
        assert rec["decode_s"] > 0 and rec["kv_peak_bytes"] > 0

    # A second adapter on the same journal answers everything from it, computing nothing.
    lm2 = RefusionBenchLM(pretrained=str(ckpt), decoder="ar", journal_dir=str(tmp_path / "j"))
    res2 = _evaluate(lm2, tmp_path / "tasks", "tiny_gen", apply_chat_template=True, log_samples=True)
    assert lm2.computed == 0 and lm2.served == 4
    assert [s["resps"] for s in res2["samples"]["tiny_gen"]] == [s["resps"] for s in samples]


def test_loglikelihood_causal_is_exact(ckpt, write_task, tmp_path, assert_close):
    from harness.run.lm_adapter import RefusionBenchLM

    lm = RefusionBenchLM(pretrained=str(ckpt), decoder="ar")
    res = _evaluate(lm, write_task(tmp_path / "tasks", "tiny_mc", output_type="multiple_choice"), "tiny_mc",
                    log_samples=True)
    s = res["samples"]["tiny_mc"][0]
    context, cont = s["arguments"][0]
    ll = s["resps"][0][0][0]
    ctx_ids = lm.tokenizer(context, add_special_tokens=False)["input_ids"]
    all_ids = lm.tokenizer(context + cont, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([all_ids])).logits[0].float(), -1)
    ref = sum(float(logp[i - 1, all_ids[i]]) for i in range(len(ctx_ids), len(all_ids)))
    assert_close(torch.tensor(ll), torch.tensor(ref))  # a float32 sum of log-probs, batched differently


def test_loglikelihood_mdm_monte_carlo_is_deterministic_and_unbiased_shape(mdm_ckpt, tmp_path, assert_close):
    from lm_eval.api.instance import Instance

    from harness.run.lm_adapter import RefusionBenchLM

    lm = RefusionBenchLM(pretrained=str(mdm_ckpt), decoder="llada", mc_num=32, mc_batch=8)
    assert not lm.causal
    req = Instance("loglikelihood", {}, ("what is 3 plus 4 ?", " seven"), 0, ("t", 0, 1))
    (a, ga), = lm.loglikelihood([req])
    lm._done.clear()
    (b, gb), = lm.loglikelihood([req])
    assert a == b and ga == gb and a < 0
    # One-token continuation: masking count is always 1, so every draw is the exact masked log-prob.
    one = Instance("loglikelihood", {}, ("what is 3 plus 4", " ?"), 0, ("t", 1, 1))
    (ll1, _), = lm.loglikelihood([one])
    ctx, cont = lm._split("what is 3 plus 4", " ?")
    x = torch.tensor([ctx + [lm.scorer.mask_id()] * len(cont)])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(x).logits[0].float(), -1)
    if len(cont) == 1:
        assert_close(torch.tensor(ll1), logp[len(ctx), cont[0]])


def test_bad_knobs_and_decoder_are_clear_errors(ckpt):
    from harness.run.lm_adapter import CheckpointError, RefusionBenchLM
    from refusion.decoding import make_knobs

    with pytest.raises(ValueError, match="unknown decoder 'nope'; valid decoders: .*ar"):
        RefusionBenchLM(pretrained=str(ckpt), decoder="nope")
    with pytest.raises(ValueError, match="unknown knob.*slot_sise.*valid knobs: .*gen_length"):
        make_knobs("ar", {"slot_sise": 8})
    with pytest.raises(ValueError, match="gen_length"):
        make_knobs("ar", {"gen_length": -3})
    make_knobs("ar", {"gen_length": 4})
    with pytest.raises(CheckpointError, match="does not exist"):
        RefusionBenchLM(pretrained=str(ckpt) + "_missing", decoder="ar")


@pytest.mark.slow
def test_lm_eval_cli_runs_registered_model(ckpt, write_task, tmp_path):
    """lm-eval's own command line, with the model registered, end to end."""
    import subprocess
    import sys

    tasks = write_task(tmp_path / "tasks")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "harness.lm_eval_cli", "run", "--model", "refusion_bench",
           "--model_args", f"pretrained={ckpt},decoder=ar,gen_length=3", "--tasks", "tiny_gen",
           "--include_path", str(tasks), "--apply_chat_template", "--output_path", str(out), "--limit", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tiny_gen" in p.stdout and "exact_match" in p.stdout
    assert list(out.rglob("results_*.json"))
