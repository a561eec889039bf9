"""The sdar decoder against the authors' own block_diffusion_generate (JetAstra/SDAR generate.py on their
modeling_sdar.py), on the release-layout fixture tests/fixtures/released/sdar (scripts/make_sdar_fixtures.py):
the stored generations (24 chat prompts x 5 knob settings, seeded, one prompt a call; entropy_bounded's from
generate.py with the line its branch lacks, see the script); loading the folder as published without running its
files; counting; the family in the dry run.

The full comparison (every prompt and setting, batch 1 and batch 4) is ``slow``; the default run checks every
eighth prompt at batch 1 and one batch of 4 per setting.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from refusion.decoding import DECODERS, checkpoint_defaults
from refusion.decoding.common import cut_after_eos
from refusion.decoding.sdar import SdarKnobs, quotas, to_commit

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent / "fixtures" / "released"
FIXTURES = [p.name for p in sorted(ROOT.glob("sdar*")) if (p / "reference.json").is_file()]
REFS = {name: json.loads((ROOT / name / "reference.json").read_text()) for name in FIXTURES}


def _settings(name: str) -> list[str]:
    return sorted({json.dumps(g["kwargs"], sort_keys=True) for g in REFS[name]["generations"]})


def _of(name: str, setting: str) -> list[dict]:
    return [g for g in REFS[name]["generations"] if json.dumps(g["kwargs"], sort_keys=True) == setting]


CASES = [(n, s) for n in FIXTURES for s in _settings(n)]
IDS = [f"{n}-setting{i}" for n in FIXTURES for i in range(len(_settings(n)))]


@pytest.fixture(scope="module")
def loaded():
    from harness.models.checkpoints import load_model

    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(ROOT / name)
        return cache[name]
    return get


def _knobs(g: dict) -> dict:
    return {**g["kwargs"], "seed": g["seed"]}


def _want(g: dict, eos) -> list[int]:
    """generate.py's response: its tokens after the prompt up to and including the first EOS, within the budget
    (it decodes whole blocks past it)."""
    return cut_after_eos(torch.tensor(g["output_ids"]), tuple(eos))[:g["kwargs"]["gen_length"]].tolist()


# Rows of a batch of 4 that may differ from the row alone: the MoE fixture has one. Its first divergence is a
# sampled draw (generate.py's temperature 1.0) at which the two best candidates' scores are 3.3e-7 apart
# (relative), and the batch's logits, 1.4e-5 from the row's alone (a batch's float32 sums round differently from
# one row's; expert matmuls that do not depend on the batch still part there), are enough to swap them.
# _float_tie checks that each such row is such a tie.
BATCH_FLOAT_TIES = {"sdar": 0, "sdar_moe": 1}
TIE_MARGIN, TIE_LOGITS = 1e-5, 1e-4  # relative gap of the two best draws; |logit difference| batch vs alone


def _draws(m, ids, mask, knobs: dict, row: int, monkeypatch) -> list[tuple]:
    """Every draw of batch row ``row``, in order: (block logits [L, V], the row's generator state before the
    draw, drawn tokens [L])."""
    sdar_mod = importlib.import_module("refusion.decoding.sdar")
    made, seen = [], []
    real_make, real_draw = sdar_mod.make_generator, sdar_mod.draw

    def make(*a, **kw):
        made.append(real_make(*a, **kw))
        return made[-1]

    def draw(logits, k, gen):
        state = gen.get_state()
        tok, prob = real_draw(logits, k, gen)
        if gen is made[row]:
            seen.append((logits.clone(), state, tok.clone()))
        return tok, prob

    with monkeypatch.context() as mp:
        mp.setattr(sdar_mod, "make_generator", make)
        mp.setattr(sdar_mod, "draw", draw)
        DECODERS["sdar"](m.model, ids, mask, knobs)
    return seen


def _float_tie(m, ids, mask, b: int, g: dict, monkeypatch) -> None:
    """Row ``b`` of a batch decodes differently from the same row alone: assert that it parts at a sampled draw
    that a float rounding decides. The draw is recomputed here, independently of the decoder: for one sample
    torch.multinomial(p) is argmax(p / q) with q ~ Exp(1) from the same generator state; at the first draw
    whose tokens differ the two runs must hold the same generator state, logits within TIE_LOGITS, and the
    alone run's scores of the two tokens drawn must be within TIE_MARGIN (relative)."""
    knobs = _knobs(g)
    assert (knobs["temperature"], knobs["top_k"], knobs["top_p"]) == (1.0, 0, 1.0)  # p = softmax(logits)
    width = len(g["prompt_ids"])
    alone = _draws(m, ids[b:b + 1, -width:], None, knobs, 0, monkeypatch)
    batch = _draws(m, ids, mask, knobs, b, monkeypatch)
    step = next(i for i, (x, y) in enumerate(zip(alone, batch)) if not torch.equal(x[2], y[2]))
    (la, state, ta), (lb, state_b, tb) = alone[step], batch[step]
    assert torch.equal(state, state_b)
    assert (la - lb).abs().max().item() < TIE_LOGITS
    q = torch.empty_like(la).exponential_(1, generator=torch.Generator().manual_seed(0).set_state(state))
    score_a, score_b = torch.softmax(la, -1) / q, torch.softmax(lb, -1) / q
    assert torch.equal(score_a.argmax(-1), ta) and torch.equal(score_b.argmax(-1), tb)
    for pos in (ta != tb).nonzero()[:, 0].tolist():
        first, second = score_a[pos, ta[pos]].item(), score_a[pos, tb[pos]].item()
        assert 0 <= (first - second) / first < TIE_MARGIN, (pos, first, second)


def _compare(m, left_pad, gens: list[dict], batch: int, ties: int = 0, monkeypatch=None) -> None:
    """Decode ``gens`` in left-padded batches of ``batch``; every row must give generate.py's tokens, but for at
    most ``ties`` rows of a batch, each a checked float tie (BATCH_FLOAT_TIES, _float_tie)."""
    differ = []
    pad = m.tokenizer.pad_token_id
    for i in range(0, len(gens), batch):
        group = gens[i:i + batch]
        rows = [torch.tensor(g["prompt_ids"]) for g in group]
        ids, mask = left_pad(rows, pad)
        tokens, _ = DECODERS["sdar"](m.model, ids, mask if len(rows) > 1 else None, _knobs(group[0]))
        for b, (g, t) in enumerate(zip(group, tokens)):
            if t.tolist() != _want(g, m.eos_ids):
                differ.append((batch, g["kwargs"], g["prompt_ids"]))
                if len(rows) > 1 and len(differ) <= ties:
                    _float_tie(m, ids, mask, b, g, monkeypatch)
    assert len(differ) <= (ties if batch > 1 else 0), differ


def _mixed_batch(gens: list[dict], eos) -> list[dict]:
    """The first batch of 4 (prompts of different lengths) in which some rows end early and others go on."""
    for i in range(0, len(gens) - 3):
        ends = [len(_want(g, eos)) < g["kwargs"]["gen_length"] for g in gens[i:i + 4]]
        if any(ends) and not all(ends) and len({len(g["prompt_ids"]) for g in gens[i:i + 4]}) > 1:
            return gens[i:i + 4]
    return gens[:4]


def test_the_reference_covers_24_prompts_and_several_settings():
    assert "sdar" in FIXTURES
    for name in FIXTURES:
        gens = REFS[name]["generations"]
        assert len(_settings(name)) >= 3 and all(len(_of(name, s)) == 24 for s in _settings(name))
        assert len({tuple(g["prompt_ids"]) for g in gens}) == 24
        assert all(g["generator"] == "sdar.generate.block_diffusion_generate" for g in gens)
        assert REFS[name]["upstream"][0]["repo"] == "JetAstra/SDAR"
        lengths = {len(g["prompt_ids"]) % 4 for g in gens}
        assert len(lengths) > 1  # prompts end at different offsets in their block


@pytest.mark.parametrize("name,setting", CASES, ids=IDS)
def test_authors_tokens_seed_for_seed_subset(loaded, name, setting, left_pad, monkeypatch):
    m = loaded(name)
    gens = _of(name, setting)
    _compare(m, left_pad, gens[::8], 1)
    _compare(m, left_pad, _mixed_batch(gens, m.eos_ids), 4, BATCH_FLOAT_TIES[name], monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name,setting", CASES, ids=IDS)
def test_authors_tokens_seed_for_seed_all_prompts(loaded, name, setting, batch, left_pad, monkeypatch):
    _compare(loaded(name), left_pad, _of(name, setting), batch, BATCH_FLOAT_TIES[name], monkeypatch)


@pytest.mark.parametrize("name", FIXTURES)
def test_loads_without_running_the_folders_code_and_gives_the_authors_logits(loaded, name, assert_close):
    """The folder's modeling / configuration / tokenizer files raise on import; the harness loads it anyway, onto
    the stock class, and a block-causal forward gives the logits of the authors' SDARForCausalLM."""
    from safetensors.torch import load_file

    from refusion.decoding.common import forward, Meter

    folder = ROOT / name
    cfg = json.loads((folder / "config.json").read_text())
    for module in {v.split(".")[0] for v in cfg["auto_map"].values()}:
        spec = importlib.util.spec_from_file_location(f"fixture_{module}", folder / f"{module}.py")
        with pytest.raises(ImportError, match="must not be imported"):
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    m = loaded(name)
    assert m.family.name == cfg["model_type"] and type(m.model).__name__ == m.family.model_class
    assert m.mask_id == cfg["mask_token_id"] == m.tokenizer.convert_tokens_to_ids("<|MASK|>")
    gen_eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert set(gen_eos) <= set(m.eos_ids)
    ref = REFS[name]["logits"]
    ids = torch.tensor([ref["input_ids"]])
    blk = torch.arange(ids.shape[1]) // ref["block_length"]
    visible = blk[None, :] <= blk[:, None]
    got = forward(m.model, Meter(m.model, ("x",)), "x", ids, position_ids=torch.arange(ids.shape[1])[None],
                  visible=visible)
    assert_close(got[0], load_file(str(folder / "reference.safetensors"))["block_causal_logits"])


def test_counting_phases_and_commits(loaded):
    """NFE = prefill + denoise + store forwards, one store per row block, TPF = tokens / NFE; every token committed
    by a denoise forward; a prompt of whole blocks is prefilled, one shorter than a block is not."""
    m = loaded("sdar")
    for g in _of("sdar", _settings("sdar")[0])[::5]:
        tokens, s = DECODERS["sdar"](m.model, torch.tensor([g["prompt_ids"]]), None, _knobs(g))
        n = tokens[0].numel()
        assert s["nfe"] == s["nfe_prefill"] + s["nfe_denoise"] + s["nfe_store"] and s["tpf"] == n / s["nfe"]
        assert s["nfe_prefill"] == 1 and s["nfe_store"] == s["blocks"] and s["nfe_denoise"] == s["denoise_steps"]
        assert s["block_length"] == g["kwargs"]["block_length"] and s["kv_peak_bytes"] > 0
        assert s["nfe_denoise"] <= s["blocks"] * (g["kwargs"]["denoising_steps"] + 1)
        phases = s["forward_phase"]
        assert phases[0] == "prefill" and all(phases[f] == "denoise" for f in s["commit_forward"][0])
        assert len(s["commit_forward"][0]) == n
    short = _of("sdar", _settings("sdar")[0])[0]["prompt_ids"][:3]
    _, s = DECODERS["sdar"](m.model, torch.tensor([short]), None, {"gen_length": 8})
    assert s["nfe_prefill"] == 0 and s["forward_phase"][0] == "denoise"


def test_greedy_is_the_argmax_and_each_strategy_decodes(loaded):
    """temperature 0 (ours; generate.py always draws) is deterministic whatever the seed; every strategy runs."""
    m = loaded("sdar")
    ids = torch.tensor([_of("sdar", _settings("sdar")[0])[3]["prompt_ids"]])
    a, _ = DECODERS["sdar"](m.model, ids, None, {"gen_length": 16, "temperature": 0.0, "seed": 1})
    b, _ = DECODERS["sdar"](m.model, ids, None, {"gen_length": 16, "temperature": 0.0, "seed": 2})
    assert a[0].tolist() == b[0].tolist() and a[0].numel() > 0
    for strategy in ("low_confidence_dynamic", "low_confidence_static", "sequential", "entropy_bounded"):
        t, s = DECODERS["sdar"](m.model, ids, None, {"gen_length": 16, "remasking_strategy": strategy})
        assert t[0].numel() > 0 and s["nfe_denoise"] >= s["blocks"]


def test_quotas_and_strategies_by_hand():
    """The step quotas (block_length over denoising_steps, remainder first) and each rule on a hand-made block."""
    assert quotas(4, 4) == [1, 1, 1, 1] and quotas(8, 3) == [3, 3, 2] and quotas(4, 8) == [1, 1, 1, 1, 0, 0, 0, 0]
    masked = torch.tensor([False, True, True, True])
    prob = torch.tensor([0.99, 0.9, 0.5, 0.95])
    pick = lambda strategy, quota, **kw: to_commit(SdarKnobs(remasking_strategy=strategy, **kw), masked, prob,
                                                  quota).tolist()
    assert pick("low_confidence_dynamic", 1) == [False, True, False, True]  # both above 0.85
    assert pick("low_confidence_dynamic", 1, confidence_threshold=0.92) == [False, False, False, True]
    assert pick("low_confidence_dynamic", 3, confidence_threshold=0.92) == [False, True, True, True]  # the quota
    assert pick("low_confidence_static", 2) == [False, True, False, True]
    assert pick("sequential", 2) == [False, True, True, False]
    # entropy_bounded: every masked position carries the block's sum of -p log p; k = how many running sums
    # stay below eb_threshold, at least one.
    h = float(-(prob * prob.log()).sum())  # ~0.51
    assert sum(pick("entropy_bounded", 1, eb_threshold=h * 3 + 1e-3)) == 3
    assert sum(pick("entropy_bounded", 1, eb_threshold=h * 2 + 1e-3)) == 2
    assert sum(pick("entropy_bounded", 1, eb_threshold=h + 1e-3)) == 1
    assert sum(pick("entropy_bounded", 1, eb_threshold=0.0)) == 1
    with pytest.raises(ValueError, match="denoising_steps must be >= block_length"):
        SdarKnobs(remasking_strategy="entropy_bounded", block_length=8, denoising_steps=4)


def test_knob_defaults_are_generate_py_and_the_folder_sets_its_block(tmp_path):
    """generate.py's argparse defaults (block 4, 4 steps, low_confidence_dynamic 0.85, eb 0.35, temperature 1,
    top_k 0, top_p 1), one of the reference settings; a folder's config.json block_size sets the block."""
    k = SdarKnobs()
    defaults = {n: v for n, v in k.to_dict().items() if n not in ("gen_length", "seed")}
    assert any({n: g["kwargs"][n] for n in defaults} == defaults for g in REFS["sdar"]["generations"])
    assert (k.block_length, k.denoising_steps, k.remasking_strategy, k.confidence_threshold, k.eb_threshold,
            k.temperature, k.top_k, k.top_p) == (4, 4, "low_confidence_dynamic", 0.85, 0.35, 1.0, 0, 1.0)
    assert checkpoint_defaults("sdar", ROOT / "sdar") == {"block_length": 4, "denoising_steps": 4}
    folder = shutil.copytree(ROOT / "sdar", tmp_path / "b8", ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "block_size": 8}))
    assert checkpoint_defaults("sdar", folder) == {"block_length": 8, "denoising_steps": 8}


# ---------------------------------------------------------------- the dry run


@pytest.mark.parametrize("name", FIXTURES)
def test_dry_run_recognises_the_family_and_its_block(tmp_path, dry_run, one_error, name):
    rc, out, err = dry_run(f"s={ROOT / name}:sdar")
    assert rc == 0, err
    assert f"({name} family, causal)" in out and "block_length=4" in out and "denoising_steps=4" in out, out


def test_the_trace_draws_blocks_on_absolute_positions(loaded):
    """make trace: SDAR's first block also holds the prompt's last prompt_tokens % block_length tokens, so its
    answer's first block is shorter (harness/report/trace.py reads the knob class's blocks_from_prompt_start)."""
    from harness.report.trace import entry
    from harness.report.trace_draw import groups

    rec = {"tokens": [5] * 10, "knobs": {}, "nfe": 12, "commit_forward": list(range(1, 11)),
           "commit_kind": ["denoise"] * 10, "forward_phase": ["prefill"] + ["denoise"] * 11, "prompt_tokens": 7}
    m = entry("s", "sdar", rec, loaded("sdar").tokenizer, {302})
    assert m["group"] == {"name": "block", "size": 4, "offset": 1}
    assert groups(m) == [(0, 1), (1, 5), (5, 9), (9, 10)]
    assert groups({**m, "group": {"name": "block", "size": 4}}) == [(0, 4), (4, 8), (8, 10)]  # other decoders
