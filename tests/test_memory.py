"""Peak decode memory (harness/run/memory.py) and its released-size estimate (harness/speed/memory_estimate.py).

The tracker is checked against an independent count, the CPU allocator's own running total as torch.profiler
records it, for four decoders on the committed tiny checkpoints (batch 4, a 32-token prompt, generation 64; 256
under the slow marker); against the KV cache and logits computed from the config; for determinism; and for a
leak (a decoder that keeps every step's logits must show a larger peak). The estimator's fake-tensor phases
are checked against the same phases run with real tensors, and against the real decoders' measured peaks.
"""

import json
from pathlib import Path

import pytest
import torch

from harness.models.checkpoints import load_model
from harness.run.memory import DecodeMemory, StorageTracker, measure_decode, profiler_peak, weights_bytes
from harness.speed import memory_estimate as est
from refusion.decoding import DECODERS
from refusion.decoding.knobs import LOGITS_CHUNK

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, PROMPT = 4, 32
SDAR_FIXTURE = Path(__file__).parent / "fixtures" / "released" / "sdar"
CHECKPOINT = {"ar": "ar", "refusion": "refusion", "llada": "mdm", "fast_dllm": "mdm", "d2f": "d2f"}


def knobs(decoder: str, gen: int) -> dict:
    """Valid knobs at response length ``gen``: LLaDA's steps a multiple of its gen / 32 blocks (4 tokens a step)."""
    return {"gen_length": gen, **({"steps": gen // 4} if decoder == "llada" else {})}


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """checkpoint name -> the loaded tiny model (harness's loader), loaded once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(tiny_checkpoint(name)).model
        return cache[name]

    return get


@pytest.fixture(scope="module")
def prompt():
    vocab = 915  # the tiny checkpoints' vocabulary; ids 0-3 are special
    return torch.randint(4, vocab, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def measured(models, prompt):
    """(decoder, gen) -> (tracker result, stats, profiler peak), each decode measured once per module: the
    tracker first, then the same decode under the profiler."""
    cache = {}

    def get(decoder: str, gen: int):
        if (decoder, gen) not in cache:
            model = models(CHECKPOINT[decoder])
            _, stats, mem = measure_decode(decoder, model, prompt, **knobs(decoder, gen))
            peak, _ = profiler_peak(lambda: DECODERS[decoder](model, prompt, **knobs(decoder, gen)))
            cache[decoder, gen] = (mem, stats, peak)
        return cache[decoder, gen]

    return get


def kv_bytes(config, batch: int, tokens: int, itemsize: int) -> int:
    """2 (keys, values) x layers x batch x tokens x kv heads x head dim x bytes per element."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * batch * tokens * config.num_key_value_heads * head_dim * itemsize


def check_against_profiler(mem: dict, stats: dict, profiled: int) -> None:
    assert mem["method"].startswith("dispatch") and mem["peak_bytes"] == mem["dispatch_peak_bytes"]
    # Both count the call's new memory: the tracker storage bytes, the allocator the bytes it handed out (the
    # CPU allocator reports each request's size, no rounding), plus kernels' scratch the tracker cannot see.
    assert abs(mem["peak_bytes"] - profiled) <= 0.05 * profiled, (mem["peak_bytes"], profiled)
    assert sum(mem["breakdown"].values()) == mem["peak_bytes"]
    assert all(v >= 0 for v in mem["breakdown"].values())
    assert mem["allocations"] > stats["nfe"]


def check_ar_bound(model, mem: dict, stats: dict) -> None:
    """The ar peak holds at least its final KV cache (prompt + one token per forward after the prefill) plus one
    step's float32 logits [B, 1, V]."""
    cfg = model.config
    tokens = PROMPT + stats["nfe"] - 1
    floor = kv_bytes(cfg, BATCH, tokens, model.dtype.itemsize) + BATCH * cfg.vocab_size * 4
    assert mem["peak_bytes"] >= floor, (mem["peak_bytes"], floor)
    assert stats["kv_peak_bytes"] == kv_bytes(cfg, BATCH, tokens, model.dtype.itemsize)  # the meter agrees


@pytest.mark.parametrize("decoder", sorted(CHECKPOINT))
def test_tracker_peak_matches_the_cpu_allocator(measured, decoder):
    mem, stats, profiled = measured(decoder, 64)
    check_against_profiler(mem, stats, profiled)
    cached = decoder != "llada"  # llada decodes with no cache
    assert (mem["breakdown"]["kv_cache"] > 0) == cached


@pytest.mark.slow
@pytest.mark.parametrize("decoder", sorted(CHECKPOINT))
def test_tracker_peak_matches_the_cpu_allocator_at_256(measured, models, decoder):
    mem, stats, profiled = measured(decoder, 256)
    check_against_profiler(mem, stats, profiled)
    if decoder == "ar":
        check_ar_bound(models("ar"), mem, stats)


def test_ar_peak_holds_the_kv_cache_and_a_steps_logits(measured, models):
    mem, stats, _ = measured("ar", 64)
    check_ar_bound(models("ar"), mem, stats)
    assert mem["weights_bytes"] == weights_bytes(models("ar")) > 0


def test_two_runs_count_the_same_bytes(models, prompt):
    model = models("ar")
    runs = [measure_decode("ar", model, prompt, gen_length=32)[2] for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_decoder_that_keeps_every_steps_logits_shows_a_larger_peak(measured, models, prompt):
    model = models("ar")
    plain, stats, _ = measured("ar", 64)
    kept = []
    hook = model.register_forward_hook(lambda m, a, out: kept.append(out.logits))  # the leak
    try:
        with DecodeMemory(model) as mem:
            DECODERS["ar"](model, prompt, gen_length=64)
    finally:
        hook.remove()
    leaky = mem.result()
    cfg = model.config
    assert len(kept) == stats["nfe"]
    # when the last forward runs, the leak holds the prefill's logits [B, P, V] and every earlier step's
    # [B, 1, V] (float32) beside the KV cache of the tokens forwarded so far: the peak holds all of it, in the
    # breakdown as logits
    held = BATCH * (PROMPT + stats["nfe"] - 2) * cfg.vocab_size * 4
    kv = kv_bytes(cfg, BATCH, PROMPT + stats["nfe"] - 2, model.dtype.itemsize)
    assert leaky["peak_bytes"] >= kv + held > plain["peak_bytes"]
    assert leaky["breakdown"]["logits"] >= held > plain["breakdown"]["logits"]


def test_only_storages_made_inside_count():
    before = torch.ones(1000)  # 4000 bytes made before: never counted, nor its views or in-place changes
    with StorageTracker() as tracker:
        before[10:].add_(1)
        view = before.view(10, 100)
        a = before * 2  # 4000
        b = torch.tensor([1.0, 2.0])  # 8, through lift_fresh
        del a  # freed: 8 live
        c = torch.empty(250)  # 1000
        d = c[::2].clone()  # 500
    breakdown = tracker.close()
    assert (tracker.peak_bytes, tracker.allocations) == (4008, 4)
    assert tracker.live_bytes == 8 + 1000 + 500 and breakdown == {"kv_cache": 0, "logits": 0, "other": 4008}
    del view, b, d


def test_breakdown_names_the_cache_and_the_logits(models, prompt):
    """At a peak forced after a forward: the cache (also what a commit concatenated onto it after the forward),
    the head's logits and the probabilities computed from them, and the rest."""
    from transformers import DynamicCache

    from refusion.decoding.common import cache_append, cache_bytes

    model = models("ar")
    with torch.no_grad(), DecodeMemory(model) as mem:
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=prompt, cache=cache, use_cache=True).logits  # [B, P, V]
        probs = logits[:, -8:].softmax(-1)  # [B, 8, V], from the logits
        cache_append(cache, [[(lay.keys[:, :, :2], lay.values[:, :, :2]) for lay in cache.layers]])  # a commit
        mask = torch.zeros(logits.shape, dtype=torch.bool)  # vocabulary-sized, not from the logits
        spike = torch.zeros(4_000_000)  # 16 MB: the peak is now, everything above live
    got = mem.result()["breakdown"]
    assert got["kv_cache"] == cache_bytes(cache) > 0
    assert got["logits"] == logits.nbytes + probs.nbytes
    assert got["other"] >= spike.nbytes + mask.nbytes


def test_a_commit_of_the_forwards_own_kv_widens_the_cache_in_place(models, prompt):
    """cache_append of the KV a crop just cut off (a forward's query, kept after the answer): the layer's view is
    widened over the same storage, no copy, and equals the concatenation; KV from elsewhere is concatenated."""
    from transformers import DynamicCache

    from refusion.decoding.common import cache_append

    model = models("ar")
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt[:, :-6], cache=cache, use_cache=True)
        t = cache.get_seq_length()
        model(input_ids=prompt[:, -6:], cache=cache, use_cache=True)  # the query's KV after the prompt's
        kv = [(lay.keys[:, :, -6:], lay.values[:, :, -6:]) for lay in cache.layers]
        want = [(lay.keys[:, :, :t + 4].clone(), lay.values[:, :, :t + 4].clone()) for lay in cache.layers]
        storages = [lay.keys.untyped_storage().data_ptr() for lay in cache.layers]
        cache.crop(-6)
        cache_append(cache, [[(k[:, :, :4], v[:, :, :4]) for k, v in kv]])  # 4 of the 6 kept
        assert cache.get_seq_length() == t + 4
        for lay, (k, v), ptr in zip(cache.layers, want, storages):
            assert torch.equal(lay.keys, k) and torch.equal(lay.values, v)
            assert lay.keys.untyped_storage().data_ptr() == ptr  # no copy
        other = [(k[:, :, 4:].clone(), v[:, :, 4:].clone()) for k, v in kv]  # the same values, another storage
        cache_append(cache, [other])
        for lay, (k, v), ptr in zip(cache.layers, kv, storages):
            assert torch.equal(lay.keys[:, :, -6:], k) and lay.keys.untyped_storage().data_ptr() != ptr


def test_compiled_decoding_is_refused(models, prompt):
    with pytest.raises(ValueError, match="compile"):
        measure_decode("ar", models("ar"), prompt, gen_length=4, compile=True)


# ---------------------------------------------------------------- the released-size estimate


# every phase on a committed tiny checkpoint (SDAR and LLaDA2 on their released-layout fixtures; LLaDA2's phases
# take the worst-case routing on both sides), the streamed decoders also with logits_chunk 16
FIXTURES = {"sdar": SDAR_FIXTURE, "llada2": SDAR_FIXTURE.parent / "llada2"}
TINY_CASES = [(ckpt, dec, chunk) for ckpt, decs in {**est.TINY_DECODERS, "sdar": ("sdar",), "llada2": ("llada2",)}.items()
              for dec in decs for chunk in ((None, 16) if dec in est.STREAMED else (None,))]


@pytest.mark.parametrize("ckpt,decoder,chunk", TINY_CASES)
def test_fake_phases_count_what_real_phases_count(models, tiny_checkpoint, ckpt, decoder, chunk):
    """Each phase on fake tensors (the estimator's path) against the same phase on the real tiny model."""
    folder = FIXTURES[ckpt] if ckpt in FIXTURES else tiny_checkpoint(ckpt)
    real = load_model(folder).model if ckpt in FIXTURES else models(ckpt)
    mode = est.FakeTensorMode()
    fake = est.fake_tiny(folder, mode) if ckpt not in FIXTURES else est.fake_model(  # in the real one's dtype
        ckpt, json.loads((folder / "config.json").read_text()), real.dtype, mode)
    assert weights_bytes(fake) == weights_bytes(real)
    shape = est.Shape(BATCH, PROMPT, 64, chunk=chunk)
    got = est.phase_peaks(fake, decoder, shape, mode)
    want = est.phase_peaks(real, decoder, shape)
    assert set(got) == set(want) == set(est.PHASES[decoder])
    for phase in got:
        assert abs(got[phase]["peak_bytes"] - want[phase]["peak_bytes"]) <= 0.05 * want[phase]["peak_bytes"], phase
    top = max(want.values(), key=lambda v: v["peak_bytes"])["peak_bytes"]
    assert abs(est.estimate(fake, decoder, shape, mode)["peak_bytes"] - top) <= 0.05 * top


def test_worst_case_routing_is_the_models_expert_loop_when_every_token_picks_the_same_experts():
    """The estimator's LLaDA2 expert loop (``_routing_worst_case``) against the model's own, on a routing that is
    that worst case: every token's k choices are experts 0..k-1. The same output, bit for bit."""
    model = load_model(FIXTURES["llada2"]).model
    experts = next(m for m in model.modules() if type(m).__name__ == "Experts")
    n, k = 5, model.config.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, model.config.hidden_size, generator=g)
    ids = torch.arange(k).expand(n, k)
    weights = torch.rand(n, k, generator=g)
    own = type(experts).forward
    with torch.no_grad():
        want = experts(x, ids, weights)
        with est._routing_worst_case():
            assert type(experts).forward is not own  # the estimator's loop runs here
            got = experts(x, ids, weights)
    assert type(experts).forward is own and torch.equal(got, want)


@pytest.mark.parametrize("decoder", sorted(CHECKPOINT))
def test_estimate_on_tiny_matches_the_measured_decode(measured, models, decoder):
    """The phases are the decoder's largest moments: their maximum on the real tiny model is the decode's
    measured peak, within 5% (these decodes run their whole length or peak in their first forward)."""
    mem, _, _ = measured(decoder, 64)
    got = est.estimate(models(CHECKPOINT[decoder]), decoder, est.Shape(BATCH, PROMPT, 64))
    assert abs(got["peak_bytes"] - mem["peak_bytes"]) <= 0.05 * mem["peak_bytes"], (got, mem["peak_bytes"])


@pytest.mark.parametrize("decoder,extra", [("llada", {"steps": 16}), ("fast_dllm", {}), ("fast_dllm", {"cache": "prefix"}),
                                           ("dream", {"steps": 16})])
@pytest.mark.parametrize("chunk", [16, LOGITS_CHUNK])
def test_streamed_logits_keep_the_tokens_and_lower_the_peak(tiny_qwen3, prompt, decoder, extra, chunk):
    """logits_chunk 16 and its default (the LM head on 4 x chunk rows at a time, at the decided positions only)
    against the same decode with the knob none (the model's own forward), on a model whose logits dominate the
    peak (vocabulary 4096, hidden 32): the same tokens and forwards, and a lower peak; the estimator's phases give
    the measured peak within 5%, streamed or not."""
    model = tiny_qwen3(vocab=4096, causal=False, mask=4095, eos=2, pad=0, init_range=0.1)
    ids = prompt % 4000 + 4
    full, full_stats, full_mem = measure_decode(decoder, model, ids, gen_length=64, logits_chunk=None, **extra)
    got, stats, mem = measure_decode(decoder, model, ids, gen_length=64, logits_chunk=chunk, **extra)
    assert all(torch.equal(a, b) for a, b in zip(full, got)) and len(full) == len(got) == BATCH
    assert stats["nfe"] == full_stats["nfe"]
    assert mem["peak_bytes"] < 0.6 * full_mem["peak_bytes"]
    if decoder != "dream":  # dream's phases take its first, widest step with one more, as its worst case
        name = "fast_dllm (prefix)" if extra.get("cache") == "prefix" else decoder
        for c, measured_peak in ((chunk, mem["peak_bytes"]), (None, full_mem["peak_bytes"])):
            guess = est.estimate(model, name, est.Shape(BATCH, PROMPT, 64, chunk=c))["peak_bytes"]
            assert abs(guess - measured_peak) <= 0.05 * measured_peak, (c, guess, measured_peak)


def test_cli_writes_the_table(tmp_path, monkeypatch, tiny_checkpoint):
    raw = json.loads((tiny_checkpoint("refusion") / "config.json").read_text())
    monkeypatch.setattr(est, "RELEASED", {"tiny": est.Released("refusion", raw, ("refusion", "ar"), "test")})
    out = tmp_path / "memory.json"
    assert est.main(["--out", str(out), "--batches", "1", "2", "--prompt", "8", "--gen", "16"]) == 0
    table = json.loads(out.read_text())
    entry = table["models"]["tiny"]
    assert entry["weights_bytes"] > 0 and set(entry["decoders"]) == {"refusion", "ar"}
    for decoder, per_batch in entry["decoders"].items():
        assert set(per_batch) == {"1", "2"}
        assert per_batch["2"]["peak_bytes"] > per_batch["1"]["peak_bytes"] > 0
        assert per_batch["1"]["phase"] in est.PHASES[decoder]
    assert table["settings"]["gen"] == 16


@pytest.mark.slow
def test_released_table_at_full_size():
    """The released models: every estimate with the model's own forward (logits_chunk none where the decoder has
    it) holds at least the logits its largest forward makes in the model's dtype (the LM head over every
    forwarded position); the default streamed estimate is lower; the floor is the sum of its parts; built and run
    in a few minutes."""
    table = est.released_table(batches=(1, 8), prompt=256, gen=512)
    # the forward with the most logits: ar's prefill; d2f's prompt and first block; sdar's and llada2's block (their
    # prefills are for KV only and make none)
    largest = {"ar": 256, "sdar": 4, "llada2": 32, "d2f": 256 + 32}
    for name, entry in table["models"].items():
        rel = est.RELEASED[name]
        vocab = rel.config["vocab_size"]
        assert entry["weights_bytes"] > 13 * 2**30
        for decoder, per_batch in entry["decoders"].items():
            for b, e in per_batch.items():
                q = largest.get(decoder, 256 + 512)
                full = e["full"] if decoder in est.STREAMED else e
                assert full["peak_bytes"] >= int(b) * q * vocab * 2, (name, decoder, b)
                assert sum(e["breakdown"].values()) == e["peak_bytes"]
                assert e["floor"]["bytes"] == sum(v for k, v in e["floor"].items() if k != "bytes")
                if decoder in est.STREAMED:
                    assert e["peak_bytes"] < full["peak_bytes"] and e["logits_chunk"] == LOGITS_CHUNK


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_and_tracker_agree(tiny_checkpoint, prompt):
    model = load_model(tiny_checkpoint("ar"), device="cuda").model
    ids = prompt.cuda()
    DECODERS["ar"](model, ids, gen_length=64)  # warm-up: cuBLAS workspaces and the like stay allocated after it
    _, _, mem = measure_decode("ar", model, ids, gen_length=64)
    assert mem["method"] == "cuda allocator" and mem["device"].startswith("cuda")
    # the allocator rounds blocks up and counts scratch: at or above the tracker's storages, within 15%
    assert mem["dispatch_peak_bytes"] <= mem["peak_bytes"] <= 1.15 * mem["dispatch_peak_bytes"]
    _, _, alone = measure_decode("ar", model, ids, gen_length=64, dispatch=False)
    assert alone["breakdown"] is None and alone["peak_bytes"] == mem["peak_bytes"]
