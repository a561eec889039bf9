"""The diffusion_gemma decoder against transformers' own DiffusionGemmaGenerationMixin.generate, on the
release-layout fixture tests/fixtures/released/diffusiongemma (scripts/make_release_fixtures.py
--only-diffusiongemma): the stored generations of generate (24 chat prompts x 3 knob settings, seed 17,
one prompt a call) and live generate calls at other settings; its counting; the family in the dry run.

The full comparison (every prompt and setting, batch 1 and batch 4) is ``slow``; the default run checks
every fourth prompt at batch 1 and one batch of 4 per setting.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from refusion.decoding import DECODERS, check_attention, checkpoint_defaults
from refusion.decoding.common import cut_after_eos
from refusion.decoding.diffusion_gemma import DiffusionGemmaKnobs

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.reference]

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "released" / "diffusiongemma"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
GENS = REFERENCE["generations"]
SETTINGS = sorted({json.dumps(g["kwargs"], sort_keys=True) for g in GENS})


@pytest.fixture(scope="module")
def loaded():
    from harness.models.checkpoints import load_model

    return load_model(FIXTURE)


def _knobs(g: dict) -> dict:
    """A stored generation's generate kwargs as decoder knobs (max_new_tokens is the budget)."""
    kw = dict(g["kwargs"])
    return {"gen_length": kw.pop("max_new_tokens"), "seed": g["seed"], **kw}


def _want(g: dict, eos) -> list[int]:
    """generate's response: its tokens up to and including the first EOS (after it generate writes pad)."""
    return cut_after_eos(torch.tensor(g["output_ids"]), tuple(eos)).tolist()


def _of(setting: str) -> list[dict]:
    return [g for g in GENS if json.dumps(g["kwargs"], sort_keys=True) == setting]


def _decode_rows(loaded, left_pad, gens: list[dict], batch: int) -> list[list[int]]:
    """Decode ``gens`` (one setting) in left-padded batches of ``batch`` (the tokenizer's pad id): each row's tokens."""
    out = []
    pad = loaded.tokenizer.pad_token_id
    for i in range(0, len(gens), batch):
        group = gens[i:i + batch]
        rows = [torch.tensor(g["prompt_ids"]) for g in group]
        ids, mask = left_pad(rows, pad)
        tokens, _ = DECODERS["diffusion_gemma"](loaded.model, ids, mask if len(rows) > 1 else None, _knobs(group[0]))
        out += [t.tolist() for t in tokens]
    return out


def _compare(loaded, left_pad, gens: list[dict], batch: int) -> None:
    got = _decode_rows(loaded, left_pad, gens, batch)
    for g, tokens in zip(gens, got):
        assert tokens == _want(g, loaded.eos_ids), (batch, g["kwargs"], g["prompt_ids"])


def test_the_reference_covers_24_prompts_and_3_settings():
    assert len(SETTINGS) == 3 and all(len(_of(s)) == 24 for s in SETTINGS)
    assert len({tuple(g["prompt_ids"]) for g in GENS}) == 24
    assert all(g["generator"] == "transformers.DiffusionGemmaForBlockDiffusion.generate" for g in GENS)


def _mixed_batch(gens: list[dict], eos) -> list[dict]:
    """The first batch of 4 in which some rows end (EOS) in the first canvas and others go on, so the batch
    drops rows between canvases; else the first 4."""
    for i in range(0, len(gens), 4):
        ends = [len(_want(g, eos)) <= 16 for g in gens[i:i + 4]]
        if any(ends) and not all(ends):
            return gens[i:i + 4]
    return gens[:4]


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"setting{i}" for i in range(len(SETTINGS))])
def test_generate_tokens_seed_for_seed_subset(loaded, left_pad, setting):
    gens = _of(setting)
    _compare(loaded, left_pad, gens[::4], 1)  # 6 prompts alone
    _compare(loaded, left_pad, _mixed_batch(gens, loaded.eos_ids), 4)  # one left-padded batch of 4


def test_the_default_subset_drops_finished_rows_from_a_batch(loaded):
    assert all(any(len(_want(g, loaded.eos_ids)) <= 16 for g in _mixed_batch(_of(s), loaded.eos_ids))
               for s in SETTINGS)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("setting", SETTINGS, ids=[f"setting{i}" for i in range(len(SETTINGS))])
def test_generate_tokens_seed_for_seed_all_prompts(loaded, left_pad, setting, batch):
    _compare(loaded, left_pad, _of(setting), batch)


def test_live_generate_at_other_knobs_canvas_and_seed(loaded):
    """generate called now, at knobs and a seed the stored references do not use, and another canvas length
    (generate reads it from model.config, the decoder from its knob)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    model = loaded.model
    prompt = GENS[5]["prompt_ids"]
    cases = [({"max_denoising_steps": 10, "entropy_bound": 0.3, "stability_threshold": 0, "confidence_threshold": 0.1,
               "t_min": 0.3, "t_max": 0.9}, 8, 3),
             ({"max_denoising_steps": 6}, 16, 11)]
    for knobs, canvas, seed in cases:
        saved = model.config.canvas_length
        model.config.canvas_length = canvas
        try:
            torch.manual_seed(seed)
            kw = {k: v for k, v in knobs.items() if k != "entropy_bound"}
            if "entropy_bound" in knobs:
                kw["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=knobs["entropy_bound"])
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, **kw).sequences[0, len(prompt):]
        finally:
            model.config.canvas_length = saved
        tokens, stats = DECODERS["diffusion_gemma"](model, torch.tensor([prompt]), None,
                                                    {"gen_length": 32, "canvas_length": canvas, "seed": seed, **knobs})
        assert tokens[0].tolist() == cut_after_eos(ref, loaded.eos_ids).tolist(), knobs
        assert stats["canvas_length"] == canvas


# ---------------------------------------------------------------- compile


def _first_canvas(g: dict, eos) -> list[int]:
    """generate's first canvas of ``g`` (what a budget of one canvas decodes: its draws come before the second's)."""
    return cut_after_eos(torch.tensor(g["output_ids"][:16]), tuple(eos)).tolist()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_first_canvas_is_generates_alone_and_batched(loaded, left_pad, monkeypatch, backend):
    """The knob ``compile`` (transformers' compiled pieces: a static cache, the decoder forward in one graph per
    shape) on prompts that fit the fixture's sliding window (32): a budget of one canvas gives generate's first
    canvas, seed for seed, at batch 1 and in a left-padded batch of 4, with the eager decode's counts and commit
    log; the same decode again compiles nothing."""
    from refusion.decoding import compiled

    monkeypatch.setattr(compiled, "BACKEND", backend)
    compiled.clear()
    gens, pad, eos = _of(SETTINGS[0]), loaded.tokenizer.pad_token_id, loaded.eos_ids
    for group in [[g] for g in gens[::8]] + [gens[4:8]]:
        ids, mask = left_pad([torch.tensor(g["prompt_ids"]) for g in group], pad)
        knobs = {**_knobs(group[0]), "gen_length": 16}
        mask = mask if len(group) > 1 else None
        eager, es = DECODERS["diffusion_gemma"](loaded.model, ids, mask, knobs)
        comp, cs = DECODERS["diffusion_gemma"](loaded.model, ids, mask, {**knobs, "compile": True})
        assert [t.tolist() for t in comp] == [_first_canvas(g, eos) for g in group] == [t.tolist() for t in eager]
        for key in ("nfe", "nfe_encode", "nfe_denoise", "commit_forward", "forward_phase", "kv_peak_bytes"):
            assert cs[key] == es[key], key
        assert cs["compiled"] and not es["compiled"]
    assert compiled.compilations(loaded.model) >= 2  # the decoder forward without and with self-conditioning
    _, again = DECODERS["diffusion_gemma"](loaded.model, ids, mask, {**knobs, "compile": True})
    assert again["compilations"] == 0 and again["timings"]["compile_s"] == 0.0


def test_compiled_canvases_and_dropped_rows_equal_eager(left_pad, monkeypatch):
    """Several canvases (the compiled encoder writes each canvas's KV into the static cache) and a batch whose rows
    end at different canvases (they leave the static cache): the eager decode's tokens, counts and commit log.
    The fixture's window (32) holds one prompt and no canvas, so this model copy's window is 4096 (both decodes
    run the same copy: this compares compile with eager, the test above compares with generate)."""
    from harness.models.checkpoints import load_model
    from refusion.decoding import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    copy = load_model(FIXTURE)
    copy.model.config.get_text_config().sliding_window = 4096
    eos = copy.eos_ids
    group = _mixed_batch(_of(SETTINGS[0]), eos)
    ids, mask = left_pad([torch.tensor(g["prompt_ids"]) for g in group], copy.tokenizer.pad_token_id)
    knobs = {**_knobs(group[0]), "gen_length": 48}
    eager, es = DECODERS["diffusion_gemma"](copy.model, ids, mask, knobs)
    comp, cs = DECODERS["diffusion_gemma"](copy.model, ids, mask, {**knobs, "compile": True})
    assert [t.tolist() for t in comp] == [t.tolist() for t in eager]
    for key in ("nfe", "nfe_encode", "nfe_denoise", "canvases", "commit_forward", "forward_phase", "kv_peak_bytes"):
        assert cs[key] == es[key], key
    assert es["nfe_encode"] >= 2 and es["canvases"] < len(group) * 3, "no canvas encoded, or no row left early"


def test_compile_refuses_what_a_static_cache_cannot_replay(loaded):
    """A context past the sliding window less one (the eager cache then drops tokens a static buffer keeps), and
    a canvas length other than the model's (its static decoder mask has the model's width): clear errors."""
    from harness.run.errors import known_error
    from refusion.decoding.common import KnobLimit

    prompt = torch.tensor([GENS[0]["prompt_ids"]])  # 22 tokens: with a second canvas, 38 > 31
    with pytest.raises(KnobLimit, match="sliding window") as e:
        DECODERS["diffusion_gemma"](loaded.model, prompt, None, {"gen_length": 32, "compile": True})
    try:  # as the harness's worker meets it: inside other exceptions, reported as its own one line
        raise RuntimeError("while decoding") from e.value
    except RuntimeError as outer:
        assert known_error(outer) == str(e.value) and "without compile" in str(e.value)
    with pytest.raises(KnobLimit, match="config.canvas_length"):
        DECODERS["diffusion_gemma"](loaded.model, prompt, None, {"gen_length": 8, "canvas_length": 8,
                                                                 "compile": True})


def test_counting_encoder_and_decoder_forwards(loaded):
    """NFE = encoder + decoder forwards; TPF = tokens / NFE; tpf_decoder is generate's own tokens_per_forward
    (a batch of one, no pad id inside the answer); commits come from decoder forwards; KV bytes recorded."""
    checked = 0
    for g in GENS[::5]:
        tokens, s = DECODERS["diffusion_gemma"](loaded.model, torch.tensor([g["prompt_ids"]]), None, _knobs(g))
        n = tokens[0].numel()
        assert s["nfe"] == s["nfe_encode"] + s["nfe_denoise"] and s["nfe_encode"] == s["canvases"] >= 1
        assert s["denoise_steps"] == s["nfe_denoise"] and s["tpf"] == n / s["nfe"]
        assert s["canvas_length"] == 16 and s["kv_peak_bytes"] > 0
        assert s["early_stops"] <= s["canvases"]
        steps = g["kwargs"]["max_denoising_steps"]
        assert s["nfe_denoise"] <= s["canvases"] * steps
        assert (s["early_stops"] > 0) == (s["nfe_denoise"] < s["canvases"] * steps)
        phases = s["forward_phase"]
        assert all(phases[f] == "denoise" for f in s["commit_forward"][0]) and len(s["commit_forward"][0]) == n
        if loaded.tokenizer.pad_token_id not in g["output_ids"][:n]:
            assert s["tpf_decoder"] == pytest.approx(g["tokens_per_forward"], rel=1e-6)
            checked += 1
    assert checked >= 3


def test_a_budget_that_is_no_multiple_of_the_canvas_cuts_generate_tokens(loaded):
    g = next(g for g in _of(SETTINGS[0]) if len(_want(g, loaded.eos_ids)) > 24)
    tokens, stats = DECODERS["diffusion_gemma"](loaded.model, torch.tensor([g["prompt_ids"]]), None,
                                                {**_knobs(g), "gen_length": 24})
    assert tokens[0].tolist() == _want(g, loaded.eos_ids)[:24] and stats["canvases"] == 2


def test_knobs_defaults_are_transformers_and_the_folder_sets_its_own(tmp_path):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    d = DiffusionGemmaGenerationConfig._get_default_generation_params()
    k = DiffusionGemmaKnobs()
    assert (k.gen_length, k.max_denoising_steps, k.entropy_bound, k.t_min, k.t_max, k.stability_threshold,
            k.confidence_threshold) == (d["max_new_tokens"], d["max_denoising_steps"], d["sampler_config"].entropy_bound,
                                        d["t_min"], d["t_max"], d["stability_threshold"], d["confidence_threshold"])
    assert checkpoint_defaults("diffusion_gemma", FIXTURE) == {"canvas_length": 16}  # the fixture's generation config sets none
    folder = shutil.copytree(FIXTURE, tmp_path / "dg", ignore=shutil.ignore_patterns("*.safetensors*"))
    gc = json.loads((folder / "generation_config.json").read_text())
    gc.update(max_denoising_steps=32, t_min=0.3, sampler_config={"entropy_bound": 0.2,
                                                                 "_cls_name": "EntropyBoundSamplerConfig"})
    (folder / "generation_config.json").write_text(json.dumps(gc))
    assert checkpoint_defaults("diffusion_gemma", folder) == {"canvas_length": 16, "max_denoising_steps": 32, "t_min": 0.3,
                                           "entropy_bound": 0.2}
    gc["t_max"] = -1.0
    (folder / "generation_config.json").write_text(json.dumps(gc))
    with pytest.raises(ValueError, match="generation_config.json: field t_max must be"):
        checkpoint_defaults("diffusion_gemma", folder)
    with pytest.raises(ValueError, match="t_max must be > t_min"):
        DiffusionGemmaKnobs(t_min=0.5, t_max=0.5)


def test_family_guard_both_ways():
    with pytest.raises(ValueError, match="decoder 'ar' cannot run a diffusion_gemma checkpoint.*diffusion_gemma"):
        check_attention("ar", True, "diffusion_gemma")
    with pytest.raises(ValueError, match="decoder 'diffusion_gemma' runs diffusion_gemma checkpoints only"):
        check_attention("diffusion_gemma", True, "qwen3")
    check_attention("diffusion_gemma", True, "diffusion_gemma")


# ---------------------------------------------------------------- the dry run


def test_dry_run_recognises_the_folder_and_its_canvas(tmp_path, dry_run, one_error):
    rc, out, err = dry_run(f"dg={FIXTURE}:diffusion_gemma")
    assert rc == 0, err
    assert "dg: decoder diffusion_gemma on" in out and "(diffusion_gemma family, causal)" in out, out
    assert "canvas_length=16" in out and "entropy_bound=0.1" in out, out
    err = one_error(*dry_run(f"dg={FIXTURE}:ar")[::2])
    assert "decoder 'ar' cannot run a diffusion_gemma checkpoint" in err, err


def test_fixture_keeps_the_release_layout():
    """config.json as DiffusionGemmaConfig publishes it, sharded weights with an index, Gemma's chat tokens
    and template, and the facts of scripts/release_facts.json stored with the references."""
    from transformers import AutoTokenizer

    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["architectures"] == ["DiffusionGemmaForBlockDiffusion"]
    assert cfg["text_config"]["model_type"] == "diffusion_gemma_text" and cfg["text_config"]["num_experts"] > 1
    assert cfg["vision_config"]["model_type"] == "gemma4_vision" and cfg["canvas_length"] == 16
    assert "auto_map" not in cfg
    index = json.loads((FIXTURE / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    tok = AutoTokenizer.from_pretrained(str(FIXTURE), trust_remote_code=False)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    gen = json.loads((FIXTURE / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<eos>"), tok.convert_tokens_to_ids("<end_of_turn>")]
    facts = json.loads((Path(__file__).resolve().parents[1] / "scripts" / "release_facts.json").read_text())
    assert REFERENCE["facts"] == facts["diffusiongemma"]


def test_log_likelihood_requests_are_refused_not_scored_with_a_random_canvas():
    """DiffusionGemma's forward is no causal LM's: a task asking for log-likelihoods fails naming why."""
    from harness.run.lm_adapter import RefusionBenchLM

    lm = RefusionBenchLM(pretrained=str(FIXTURE), decoder="diffusion_gemma", warmup=False)
    with pytest.raises(ValueError, match="diffusion_gemma checkpoints answer generate requests only"):
        lm.scorer.score([1, 2, 3], [4], "0" * 16)
