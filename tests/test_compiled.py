"""The decoder knob ``compile`` (refusion/decoding/compiled.py, docs/design.md "Compiled decoding").

- the static cache's surgery (common.py's helpers, ``crop``, the batch ops, assignment to a layer's keys) leaves
  exactly the keys and values a ``DynamicCache`` holds after the same operations;
- the compiled path's mask from a 2-D padding mask is transformers' own (causal and bidirectional, after a cache);
- every registered decoder returns the same tokens, NFE, TPF and commit log compiled as eager, records
  ``compiled`` / ``compilations`` / ``compile_s``, compiles at most one graph per (query bucket, cache shape) it
  meets, and compiles nothing when the same decode runs again. The default suite decodes one embedded prompt per
  decoder, with dynamo's ``aot_eager`` backend (the
  same tracing, static shapes and in-graph cache writes, without inductor's per-bucket C++ build, which takes
  ~30-60 s per bucket on this 2-core box); the ``slow`` sweep runs every decoder under inductor on several
  prompts of each embedded task.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from refusion.decoding import DECODERS, compiled
from refusion.decoding.common import cache_append, cache_keep, cache_len, cache_tail
from refusion.decoding.compiled import StaticKV, capacity_bucket, query_bucket, visibility

pytestmark = pytest.mark.usefixtures("one_thread")

GEN = 32  # response budget: small, and divisible by every decoder's default block / slot size


# ---------------------------------------------------------------- buckets


def test_buckets():
    assert [query_bucket(n) for n in (1, 2, 3, 5, 33, 64, 65, 700, 828)] == [1, 2, 4, 8, 64, 64, 128, 704, 832]
    assert [capacity_bucket(n) for n in (0, 1, 256, 257, 956)] == [256, 256, 256, 512, 1024]
    with pytest.raises(ValueError, match="query length"):
        query_bucket(0)


# ---------------------------------------------------------------- static cache surgery == DynamicCache


def _cfg():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8)


def _kv(batch: int, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 2, n, 8, generator=g), torch.randn(batch, 2, n, 8, generator=g)) for _ in range(2)]


def _same(dyn: DynamicCache, st: StaticKV, what: str) -> None:
    assert cache_len(st) == cache_len(dyn), what
    for i, (a, b) in enumerate(zip(dyn.layers, st.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"{what}: layer {i} differs"


def _model_write(cache, kv) -> None:
    """What a model forward does to a cache: one update per layer."""
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)


def _ops(cache, log):
    """One sequence of everything the decoders do to a cache, applied to ``cache``; ``log`` gets a copy of its
    content after each step (for the comparison), and the returned tails / views are compared too."""
    cache_append(cache, [_kv(1, 5, 0)])  # the prompt's KV into an empty cache
    log("append to empty")
    _model_write(cache, _kv(1, 3, 1))  # a forward after it
    log("model update")
    cache.crop(-3)  # stacked_call: crop the query straight back
    log("crop")
    _model_write(cache, _kv(1, 4, 2))
    tail = cache_tail(cache, 5, torch.tensor([3, 1]))
    log("tail (no change)")
    cache_keep(cache, 5, torch.tensor([2, 0]))  # keep rows 2 and 0 of the tail, in that order
    log("keep with rows")
    cache_append(cache, [tail, _kv(1, 2, 3)])  # several chunks, in order
    log("append chunks")
    kv = [(lay.keys[:, :, -3:], lay.values[:, :, -3:]) for lay in cache.layers]  # views of the cache's own end
    cache.crop(-3)
    cache_append(cache, [[(k[:, :, :2], v[:, :, :2]) for k, v in kv]])  # re-append part of them (aliasing)
    log("append own views")
    cache_keep(cache, 6)
    log("keep head")
    cache.batch_repeat_interleave(3)  # the replicated layout
    log("repeat")
    _model_write(cache, [(k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1)) for k, v in _kv(1, 2, 4)])
    log("update replicated")
    cache.batch_select_indices(torch.tensor([2, 0]))
    log("select rows")
    for lay in cache.layers:
        lay.keys, lay.values = lay.keys[:1], lay.values[:1]  # back to one row
    log("assign one row")
    cache_keep(cache, 4, torch.arange(0, 4))
    log("keep all of the tail")
    cache_append(cache, [_kv(1, 300, 5)])  # more than a first allocation: the static cache grows
    log("append beyond capacity")
    return tail


def test_static_cache_surgery_equals_dynamic_cache():
    dyn, st = DynamicCache(config=_cfg()), StaticKV(_cfg(), reserve=4)
    dyn_log, st_log = [], []
    snap = lambda c, out: lambda what: out.append((what, [(lay.keys.clone(), lay.values.clone()) for lay in c.layers]))  # noqa: E731
    tail_d = _ops(dyn, snap(dyn, dyn_log))
    tail_s = _ops(st, snap(st, st_log))
    for (what, a), (_, b) in zip(dyn_log, st_log):
        for i, ((ka, va), (kb, vb)) in enumerate(zip(a, b)):
            assert ka.shape == kb.shape and torch.equal(ka, kb) and torch.equal(va, vb), f"after {what}: layer {i}"
    for (ka, va), (kb, vb) in zip(tail_d, tail_s):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    _same(dyn, st, "end")
    assert st.capacity >= cache_len(st) and st.capacity % compiled.CACHE_STEP == 0


def test_static_cache_keeps_its_buffers_in_place():
    """Surgery within capacity moves no buffer (stable addresses: what CUDA graphs need), and a dead cache's
    buffers serve the next one."""
    st = StaticKV(_cfg(), reserve=64)
    cache_append(st, [_kv(1, 10, 0)])
    ptrs = [t.data_ptr() for lay in st.layers for t in (lay._k, lay._v)]
    _model_write(st, _kv(1, 3, 1))
    st.crop(-2)
    cache_keep(st, 4, torch.tensor([1, 5]))
    cache_append(st, [_kv(1, 7, 2)])
    assert [t.data_ptr() for lay in st.layers for t in (lay._k, lay._v)] == ptrs and cache_len(st) == 13
    del st
    again = StaticKV(_cfg(), reserve=64)
    cache_append(again, [_kv(1, 10, 0)])
    assert sorted(t.data_ptr() for lay in again.layers for t in (lay._k, lay._v)) == sorted(ptrs)


# ---------------------------------------------------------------- the mask of the compiled path


@pytest.mark.parametrize("causal", [True, False])
def test_visibility_is_transformers_mask(causal, tiny_qwen3):
    from transformers.masking_utils import create_causal_mask

    model = tiny_qwen3(vocab=64, causal=causal, impl="sdpa")
    batch, cached, q = 2, 5, 3
    pad = torch.ones(batch, cached + q, dtype=torch.long)
    pad[1, :2] = 0  # row 1 left-padded
    cache = DynamicCache(config=model.config)
    _model_write(cache, [(torch.zeros(batch, 2, cached, 8), torch.zeros(batch, 2, cached, 8))] * 2)
    want = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(batch, q, 32), attention_mask=pad,
                              cache=cache, position_ids=None, allow_is_causal_skip=False)
    got = visibility(model, batch, q, cached, pad, None, None, torch.device("cpu"))
    assert torch.equal(got, want[:, 0].expand_as(got))


# ---------------------------------------------------------------- tokens: compiled == eager


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for causal, name in ((True, "refusion"), (False, "mdm")):
        path = str(tiny_checkpoint(name))
        out[causal] = (AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))
    return out


def _prompts(tok, per_kind: int) -> list[torch.Tensor]:
    from refusion.tokenizer import encode_chat
    from tasks.embedded import load_split

    return [torch.tensor(encode_chat(tok, item["query"]))
            for kind in ("math", "code", "choice") for item in load_split(kind, "test")[:per_kind]]


def _knobs(entry) -> dict:
    """A short response, greedy: compiled logits differ from eager by rounding, so only tokens that an argmax
    (or a threshold) decides are compared exactly; a sampled draw (sdar's default temperature 1) is not."""
    names = entry.knobs.names()
    return {**({"gen_length": GEN} if "gen_length" in names else {}),
            **({"temperature": 0.0} if "temperature" in names else {})}


def compare(name: str, models, prompts_per_kind: int, backend: str, monkeypatch) -> dict:
    """Decode embedded prompts with decoder ``name`` eager and compiled; assert the same tokens and counts.
    Returns the compiled calls' totals."""
    monkeypatch.setattr(compiled, "BACKEND", backend)
    entry = DECODERS[name]
    model, tok = models[entry.causal]
    compiled.clear()  # counts start at 0 for this comparison: no graph of an earlier test (same model, shapes) reused
    knobs = _knobs(entry)
    total = {"compilations": 0, "compile_s": 0.0, "calls": 0, "max_q": 0}
    for i, ids in enumerate(_prompts(tok, prompts_per_kind)):
        ids = ids[None]
        eager, es = entry(model, ids, None, knobs)
        comp, cs = entry(model, ids, None, {**knobs, "compile": True})
        where = f"decoder {name!r} ({backend}), prompt {i}"
        assert [t.tolist() for t in comp] == [t.tolist() for t in eager], f"{where}: compiled tokens differ"
        for key in ("nfe", "tpf", "generated_tokens", "commit_forward", "commit_kind", "forward_phase"):
            assert cs[key] == es[key], f"{where}: {key} differs"
        assert {k: v for k, v in cs.items() if k.startswith("nfe_")} == {k: v for k, v in es.items()
                                                                          if k.startswith("nfe_")}, where
        assert es["compiled"] is False and es["compilations"] == 0 and es["timings"]["compile_s"] == 0.0
        assert cs["compiled"] is True and cs["compilations"] >= 0
        assert (cs["compilations"] > 0) <= (cs["timings"]["compile_s"] > 0), where  # a compiling call is timed apart
        t = cs["timings"]
        assert t["decode_s"] >= 0 and 0 <= t["forward_s"] <= t["decode_s"] + 1e-9, t
        total["compilations"] += cs["compilations"]
        total["compile_s"] += t["compile_s"]
        total["calls"] += 1
        total["max_q"] = max(total["max_q"], ids.shape[1] + GEN)
        if i == 0:  # the same decode again: every graph is already compiled
            _, again = entry(model, ids, None, {**knobs, "compile": True})
            assert again["compilations"] == 0 and again["timings"]["compile_s"] == 0.0, f"{where}: recompiled"
    # Bounded: at most one graph per query bucket a forward of this run can have, per cache shape (with or
    # without a cache, and the two capacities a decode's prompt lengths here can round to).
    bound = compiled.n_buckets(total["max_q"]) * 2 * 2
    assert total["compilations"] <= bound, f"decoder {name!r}: {total['compilations']} compilations > {bound}"
    assert compiled.compilations(model) == total["compilations"]
    return total


# make test keeps CI's time budget: llada (no cache) and the two decoders with cache surgery of their own
# (refusion's commits, d2f's kept blocks) under aot_eager (dynamo's tracing, static shapes and in-graph
# cache writes, without inductor's C++ build); ar and fast_dllm are compiled in make test by
# tests/test_bench_compile.py, and inductor's code generation by the flex-kernel tests of test_kernels.py.
# The other one-prompt checks run with `make test-slow`, beside the inductor sweep of every decoder below
# (llada under inductor moved there from make test: 39 s of a cold C++ build).
DEFAULT_ONE_PROMPT = {"llada", "refusion", "d2f"}


# The decoders with a ``compile`` knob that run these tiny Qwen3 models (a decoder of one model family of its own is
# compared on that family's fixture: diffusion_gemma in tests/test_decoding_diffusion_gemma.py).
COMPILABLE = [n for n in sorted(DECODERS) if "compile" in DECODERS[n].knobs.names() and DECODERS[n].family is None]


@pytest.mark.parametrize("name", [n if n in DEFAULT_ONE_PROMPT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in COMPILABLE])
def test_compiled_tokens_equal_eager_one_prompt(name, models, monkeypatch, record_property):
    total = compare(name, models, 1, "aot_eager", monkeypatch)
    record_property("compilations", total["compilations"])
    record_property("compile_s", round(total["compile_s"], 1))
    assert total["compilations"] >= 1  # it really compiled


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILABLE)
def test_compiled_tokens_equal_eager_inductor_sweep(name, models, monkeypatch, record_property):
    total = compare(name, models, 3, "inductor", monkeypatch)
    record_property("compilations", total["compilations"])
    record_property("compile_s", round(total["compile_s"], 1))


# ---------------------------------------------------------------- the variants' paths (aot_eager: quick)


@pytest.mark.slow  # about 40 s of aot_eager compiles: make test-slow
def test_compiled_refusion_variants_and_batches_equal_eager(models, left_pad, monkeypatch):
    """The paths the default decodes above barely take: parallel infill of several slots (forced: every slot
    picked, no draft accepted by verification) in the packed and replicated layouts (the cache's batch
    operations), recompute_kv (crop + a recompute forward) and no_cache; and left-padded batches of
    refusion and d2f, whose stacked calls hand the compiled path a DynamicCache (staged)."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model, tok = models[True]
    ids = _prompts(tok, 1)[0][None]
    forced = {"gen_length": 16, "slot_size": 4, "slot_threshold": 0.0, "token_threshold": 1.0}
    for extra in ({}, {"kv_layout": "replicated"}, {"recompute_kv": True}, {"no_cache": True}):
        knobs = {**forced, **extra}
        eager, es = DECODERS["refusion"](model, ids, None, knobs)
        comp, cs = DECODERS["refusion"](model, ids, None, {**knobs, "compile": True})
        assert comp[0].tolist() == eager[0].tolist() and cs["nfe"] == es["nfe"], extra
        assert es["slots_parallel_max"] > 1 and es["nfe_infill"] > 0, "the forced knobs no longer force infill"
    for name, causal, knobs in (("refusion", True, forced), ("d2f", False, {"gen_length": 16, "block_size": 8})):
        m, t = models[causal]
        batch, pad = left_pad(_prompts(t, 1), t.pad_token_id)
        eager, es = DECODERS[name](m, batch, pad, knobs)
        comp, cs = DECODERS[name](m, batch, pad, {**knobs, "compile": True})
        assert [x.tolist() for x in comp] == [x.tolist() for x in eager] and cs["nfe"] == es["nfe"], name


def test_compiled_block_loop_batches_equal_eager(models, left_pad, monkeypatch):
    """The shared block loop (refusion/decoding/block_loop.py) compiled, on sdar: a left-padded batch whose rows
    decode different numbers of blocks, so the loop drops ended rows from the static cache
    (``batch_select_indices``) besides cutting each block's denoise KV back (``cache_keep``); greedy, the same
    tokens, counts and commit log as eager."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    model, tok = models[True]
    prompts = _prompts(tok, 1)
    batch, pad = left_pad(prompts, tok.pad_token_id)
    knobs = {"gen_length": GEN, "temperature": 0.0}
    eager, es = DECODERS["sdar"](model, batch, pad, knobs)
    comp, cs = DECODERS["sdar"](model, batch, pad, {**knobs, "compile": True})
    assert [x.tolist() for x in comp] == [x.tolist() for x in eager]
    for key in ("nfe", "nfe_prefill", "nfe_denoise", "nfe_store", "blocks", "commit_forward", "forward_phase"):
        assert cs[key] == es[key], key
    assert cs["compiled"] and cs["compilations"] > 0 and not es["compiled"]
    sizes = {(len(p) + GEN - len(p) // 4 * 4 + 3) // 4 for p in prompts}  # blocks of 4 per row (absolute grid)
    assert len(sizes) > 1 or es["blocks"] < len(prompts) * max(sizes), "no row left the batch early"


# ---------------------------------------------------------------- the harness records


def test_harness_records_compile_time_apart(make_checkpoint, tmp_path):
    """lm_decode takes a call's compile seconds out of its records' decode_s and records them (split like
    decode_s, the batch's compilations on its first row); metrics.aggregate sums them per (model, task)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.run.lm_decode import DecoderCall
    from harness.run.metrics import aggregate

    path = make_checkpoint(tmp_path / "ar")
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    pause = 0.5

    def decoder(*args, **kwargs):  # an eager decode that pretends to have compiled for `pause` seconds
        import time

        tokens, stats = DECODERS["ar"](*args, **kwargs)
        time.sleep(pause)
        stats["timings"]["compile_s"] = pause
        return tokens, {**stats, "compiled": True, "compilations": 3}

    call = DecoderCall(decoder, "ar", model, tok, torch.device("cpu"), response_extract=None, warmup=True)
    items = [{"key": f"k{i}", "task": "t", "doc_id": i, "idx": 0, "context": text, "until": [],
              "knobs": {"gen_length": 4}} for i, text in enumerate(["one two", "three four five"])]
    recs = call.run(items, rank=0)
    assert [r["batch_id"] for r in recs] == ["k0", "k0"]  # one call: one resampling unit (harness/run/stats.py)
    assert call.warmup_compile == {"compilations": 3, "compile_s": pause}
    assert [r["compiled"] for r in recs] == [True, True] and [r["compilations"] for r in recs] == [3, 0]
    assert [r["compile_s"] for r in recs] == [pause / 2] * 2
    assert all(r["decode_s"] < pause / 2 for r in recs), [r["decode_s"] for r in recs]  # the pause is not decoding
    assert aggregate(recs)["compile"] == {"compiled": True, "compilations": 3, "compile_s": pause}
    assert aggregate([{**r, "compiled": False, "compilations": 0, "compile_s": 0.0} for r in recs])["compile"] == \
        {"compiled": False, "compilations": 0, "compile_s": 0.0}
