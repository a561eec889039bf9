"""Fused slot-attention kernels (refusion/kernels.py, refusion/triton_slot_attention.py) against the
reference (refusion/slot_attention.py), the attention backend in the model, and the decoder's
`attn` knob.

Cost on 2 CPU cores: flex compiles lazily (inductor's C++ backend), once per query bucket and
head shape, so the compiled kernel is checked on a few shapes that share compiles (the tiny
checkpoint's heads, which the decoder test compiles anyway, and one Qwen3-8B-like GQA 4 /
head_dim 128 shape); the full shape grid runs flex's eager path (same mask_mod and layout) and
the Triton kernel. The Triton kernel runs under TRITON_INTERPRET=1, which triton reads when it
is imported: the grid runs in one subprocess (tests/triton_interpret_check.py) so the setting
reaches no other test. On CUDA the same grid runs natively (marked gpu, skipped without one).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from refusion import kernels
from refusion.kernels import SlotLayout, flex_block_tables, flex_slot_attention, slot_attention_op
from refusion.slot_attention import slot_attention, slot_visibility

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# (prefix_len, slot_lens): one slot (plain causal), several equal and unequal slots, prefix 0 and
# not, a prefix ending mid-block and slots crossing a 128-key block edge.

# The correctness grid (the Triton interpreter subprocess gets it as JSON): several slot counts and
# lengths, prefix 0 and non-zero, GQA ratios 1 and 4, head_dim 32 and 128.
LAYOUTS = [(0, [5]), (0, [3, 5, 1]), (7, [4, 4, 4]), (19, [1, 6, 2, 9]), (130, [17, 2, 8])]
HEADS = [(4, 4), (8, 2)]  # GQA ratios 1 and 4
DIMS = [32, 128]


def qkv(prefix_len, slot_lens, heads, kv_heads, dim, batch=1, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = sum(slot_lens)
    q = torch.randn(batch, heads, n, dim, generator=g)
    k = torch.randn(batch, kv_heads, prefix_len + n, dim, generator=g)
    v = torch.randn(batch, kv_heads, prefix_len + n, dim, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_argument_before_any_kernel_runs(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel ran on bad input")

    for name in ("flex_slot_attention", "sdpa_slot_attention", "replicated_kv_attention"):
        monkeypatch.setattr(kernels, name, boom)
    q, k, v = qkv(4, [2, 3], 4, 2, 8)
    with pytest.raises(ValueError, match="slot_lens must sum to the query length 5"):
        slot_attention_op(q, k, v, 4, [2, 2], backend="flex")
    with pytest.raises(ValueError, match="prefix_len 6 is longer than the cache"):
        slot_attention_op(q, k, v, 6, [2, 3], backend="flex")
    with pytest.raises(ValueError, match="prefix_len 2 must cover the whole cache"):
        slot_attention_op(q, k, v, 2, [2, 3], backend="sdpa")
    with pytest.raises(ValueError, match=r"backend must be one of \['sdpa', 'replicated', 'reference', 'flex', "):
        slot_attention_op(q, k, v, 4, [2, 3], backend="cudnn")
    with pytest.raises(ValueError, match="slot_lens must be a non-empty sequence of positive integers"):
        slot_attention_op(q, k, v, 4, [5, 0], backend="flex")
    with pytest.raises(ValueError, match="prefix_len must be an integer >= 0"):
        SlotLayout(-1, (3,))
    with pytest.raises(ValueError, match=r"attn must be one of \['sdpa', 'flex', 'triton'\]"):
        with kernels.attention_backend(None, "xla"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_triton_without_cuda_is_one_line_naming_what_is_missing(monkeypatch):
    from refusion.decoding import DECODERS

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv(4, [2, 3], 4, 2, 8)
    for call in (lambda: slot_attention_op(q, k, v, 4, [2, 3], backend="triton"),
                 lambda: DECODERS["refusion"](object(), torch.ones(1, 3, dtype=torch.long), attn="triton")):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and ("CUDA" in msg or "triton package" in msg), msg


# ---------------------------------------------------------------- flex: block tables, eager grid, compiled


@pytest.mark.parametrize("prefix_len,slot_lens", LAYOUTS + [(9, [3] * 11), (0, [40, 1, 30])])
@pytest.mark.parametrize("block", [4, 16])
def test_flex_block_tables_list_exactly_the_blocks_with_visible_keys(prefix_len, slot_lens, block):
    """Full blocks are wholly visible, listed partial blocks hold a visible key, unlisted ones none
    (slot x other-slot blocks are skipped), padding queries see the prefix only."""
    n = sum(slot_lens)
    q_pad = -(-n // block) * block + block  # one tile of padding queries too
    kv = prefix_len + n
    vis = torch.zeros(q_pad, kv, dtype=torch.bool)
    vis[:n] = slot_visibility(prefix_len, slot_lens)
    vis[n:, :prefix_len] = True
    tables = flex_block_tables(SlotLayout(prefix_len, tuple(slot_lens)), q_pad, kv, block)
    skipped = 0
    for i, (full, part) in enumerate(tables):
        rows = vis[i * block:(i + 1) * block]
        for b in range(-(-kv // block)):
            tile = rows[:, b * block:(b + 1) * block]
            if b in full:
                assert tile.all(), (i, b)
            elif b in part:
                assert tile.any(), (i, b)
            else:
                assert not tile.any(), (i, b)
                skipped += 1
        assert not set(full) & set(part)
    if len(slot_lens) > 2 * block:
        assert skipped  # many short slots: some blocks are never visited


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("prefix_len,slot_lens", LAYOUTS)
def test_flex_mask_and_layout_match_reference_eager(prefix_len, slot_lens, heads, kv_heads, dim, assert_close):
    q, k, v = qkv(prefix_len, slot_lens, heads, kv_heads, dim, batch=2)
    ref = slot_attention(q, k, v, prefix_len, slot_lens)
    out = flex_slot_attention(q, k, v, prefix_len, slot_lens, compiled=False)
    assert_close(out, ref)
    for backend in ("sdpa", "replicated"):
        other = slot_attention_op(q, k, v, prefix_len, slot_lens, backend=backend)
        assert_close(other, ref, msg=backend)


# Compiled: GQA 1 / head_dim 32 and GQA 4 / head_dim 128, one query bucket (16) each, the key length
# varying inside it (one compile per shape). The tiny checkpoint's heads (GQA 2, head_dim 32) are
# compiled by the model and decoder tests below, so `make test` compiles GQA 4 / head_dim 128 here and
# leaves GQA 1 / head_dim 32 (eager above, compiled: 15-30 s of inductor on 2 cores) to `make test-slow`.
COMPILED_LAYOUTS = [(0, [3, 5, 1]), (19, [1, 6, 2, 4]), (200, [9, 2, 5])]


@pytest.mark.parametrize("heads,kv_heads,dim", [pytest.param(4, 4, 32, id="gqa1-d32", marks=pytest.mark.slow),
                                                pytest.param(8, 2, 128, id="gqa4-d128")])
def test_flex_compiled_matches_reference(heads, kv_heads, dim, assert_close):
    """Where inductor cannot build flex for this CPU (no AVX2, or ATEN_CPU_CAPABILITY=default), the backend
    must say so in one clear error instead of a C++ compiler dump; elsewhere it matches the reference."""
    for prefix_len, slot_lens in COMPILED_LAYOUTS:
        q, k, v = qkv(prefix_len, slot_lens, heads, kv_heads, dim, seed=prefix_len)
        ref = slot_attention(q, k, v, prefix_len, slot_lens)
        if not kernels.flex_compiles_on_cpu():
            with pytest.raises(RuntimeError, match="needs AVX2 or AVX-512 on the CPU"):
                slot_attention_op(q, k, v, prefix_len, slot_lens, backend="flex")
            continue
        out = slot_attention_op(q, k, v, prefix_len, slot_lens, backend="flex")
        assert_close(out, ref, msg=f"{prefix_len} {slot_lens}")


# ---------------------------------------------------------------- triton


def _triton_grid(env: dict, device: str, dtype: str, folder: Path, assert_close, layouts=LAYOUTS) -> list[dict]:
    """Run the grid (``layouts`` x HEADS x DIMS) in a subprocess; compare every (kernel, reference) pair it saved
    in this process."""
    grid = json.dumps({"layouts": layouts, "heads": HEADS, "dims": DIMS})
    save = folder / "pairs.pt"
    cmd = [sys.executable, str(HERE / "triton_interpret_check.py"), "--device", device, "--dtype", dtype,
           "--grid", grid, "--save", str(save)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows, pairs = json.loads(res.stdout), torch.load(save)
    for r in rows:
        out, ref = pairs[r["key"]]
        assert_close(out, ref, dtype=dtype, msg=json.dumps(r))
    return rows


# The interpreter runs every program in Python (47 s for the whole grid on a slow 2-core machine): `make test`
# takes a sample with every case of the kernel -- no prefix and several slots, a prefix split over programs
# (split-KV) with slots of 1 to 9 tokens, both GQA ratios, both head sizes, the model forward --, and
# `make test-slow` the whole grid.
TRITON_SAMPLE = [(0, [3, 5, 1]), (19, [1, 6, 2, 9])]


@pytest.mark.parametrize("layouts", [pytest.param(TRITON_SAMPLE, id="sample"),
                                     pytest.param(LAYOUTS, id="grid", marks=pytest.mark.slow)])
def test_triton_kernel_matches_reference_in_the_interpreter(layouts, tmp_path, assert_close):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    rows = _triton_grid(env, "cpu", "float32", tmp_path, assert_close, layouts)
    splits = sum(1 for r in rows if "splits" in r)  # split-KV runs of the layouts with a prefix > 16 keys
    assert splits == sum(p > 16 for p, _ in layouts) * len(HEADS) > 0
    assert len(rows) == len(layouts) * len(HEADS) * len(DIMS) + splits + 1  # the grid, splits, one model forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_matches_reference_on_cuda(dtype, tmp_path, assert_close):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The project first, then whatever the caller put on the path (packages carried beside an image's own).
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    _triton_grid(env, "cuda", dtype, tmp_path, assert_close)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_compiled_matches_reference_on_cuda(assert_close):
    for prefix_len, slot_lens in LAYOUTS:
        for heads, kv_heads in HEADS:
            q, k, v = qkv(prefix_len, slot_lens, heads, kv_heads, 128, device="cuda")
            ref = slot_attention(q, k, v, prefix_len, slot_lens)
            out = slot_attention_op(q, k, v, prefix_len, slot_lens, backend="flex")
            assert_close(out, ref, msg=f"{prefix_len} {slot_lens} {heads} {kv_heads}")


# ---------------------------------------------------------------- the model backend and the decoder


@pytest.fixture(scope="module")
def tiny_refusion(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint("refusion")
    return AutoModelForCausalLM.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


def test_model_backend_takes_the_layout_instead_of_a_mask(tiny_refusion, assert_close):
    """refusion_sdpa / refusion_flex with slot_layout= equal the model's sdpa with the dense mask;
    without a layout they are causal after the cache, and a padding mask is still honoured."""
    from transformers import DynamicCache

    from refusion.decoding.common import additive_mask

    model, _ = tiny_refusion
    kernels.register()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 900, (1, 11), generator=g)
    slots = torch.randint(4, 900, (1, 12), generator=g)
    pos = torch.cat([torch.arange(20, 24), torch.arange(13, 17), torch.arange(30, 34)])[None]

    def run(impl, **kw):
        model.set_attn_implementation(impl)
        try:
            with torch.no_grad():
                cache = DynamicCache(config=model.config)
                model(prompt, cache=cache, use_cache=True)
                packed = model(slots, position_ids=pos, cache=cache, use_cache=True, **kw).logits
                plain = model(slots, cache=DynamicCache(config=model.config), use_cache=True,
                              attention_mask=kw.get("pad")).logits if "pad" in kw or not kw else None
            return packed, plain
        finally:
            model.set_attn_implementation("sdpa")

    mask = additive_mask(slot_visibility(11, [4, 4, 4]), torch.float32)
    want, _ = run("sdpa", attention_mask=mask)
    for impl in ("refusion_sdpa", "refusion_flex"):
        if impl == "refusion_flex" and not kernels.flex_compiles_on_cpu():  # a clear error, as in the kernel test
            with pytest.raises(RuntimeError, match="needs AVX2 or AVX-512 on the CPU"):
                run(impl, slot_layout=SlotLayout(11, (4, 4, 4)))
            continue
        got, _ = run(impl, slot_layout=SlotLayout(11, (4, 4, 4)))
        assert_close(got, want, msg=impl)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():  # no layout, no mask: causal (after an empty cache here), as sdpa
        model.set_attn_implementation("refusion_sdpa")
        a = model(slots).logits
        padded = model(torch.cat([prompt[:, :3], slots], 1), attention_mask=torch.tensor([[0] * 3 + [1] * 12]),
                       position_ids=torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.arange(12)[None]], 1)).logits
        model.set_attn_implementation("sdpa")
        b = model(slots).logits
    assert_close(a, b)
    assert_close(padded[:, 3:], b)  # the 3 padding tokens are masked out


def _prompts(tokenizer, n_per_kind):
    from refusion.tokenizer import encode_chat
    from tasks.embedded import load_split

    out = []
    for kind in ("math", "code", "choice"):
        for row in load_split(kind, "test")[:n_per_kind[kind]]:
            out.append((kind, torch.tensor([encode_chat(tokenizer, row["query"])])))
    return out


# make test-slow (24 s of flex compiles): make test checks the flex kernel against the reference op by op
# (test_flex_compiled_matches_reference, test_flex_mask_and_layout_match_reference_eager) and the model's
# attention backend taking the slot layout (test_model_backend_takes_the_layout_instead_of_a_mask).
@pytest.mark.slow
def test_refusion_flex_gives_the_sdpa_tokens_on_the_tiny_checkpoint(tiny_refusion, monkeypatch):
    """20 embedded prompts (mostly math: code and choice commit in one plan + verify), the default
    run's refusion knobs: attn="flex" == attn="sdpa", token for token, with plan, global verify and
    parallel infill (several slots packed) all through the flex kernel (query buckets 16 to 256)."""
    from harness.run.presets import TINY_REFUSION_KNOBS
    from tasks.info import TASKS
    from refusion.decoding import DECODERS

    model, tok = tiny_refusion
    seen = []
    real = kernels.flex_slot_attention

    def spy(query, key, value, prefix_len, slot_lens, scale=None, **kw):
        seen.append((prefix_len, tuple(slot_lens)))
        return real(query, key, value, prefix_len, slot_lens, scale, **kw)

    monkeypatch.setattr(kernels, "flex_slot_attention", spy)
    layers = model.config.num_hidden_layers
    infill_slots = 0
    for kind, ids in _prompts(tok, {"math": 14, "code": 3, "choice": 3}):
        knobs = dict(TINY_REFUSION_KNOBS, gen_length=TASKS[f"embedded_{kind}"].gen_length)
        want, s_want = DECODERS["refusion"](model, ids, **knobs)
        before = len(seen)
        got, s_got = DECODERS["refusion"](model, ids, attn="flex", **knobs)
        assert torch.equal(got[0], want[0]), kind
        assert s_got["nfe"] == s_want["nfe"]
        assert len(seen) - before == s_got["nfe"] * layers  # every forward went through flex
        infill_slots += s_got["infill_slots"]
    assert model.config._attn_implementation == "sdpa"  # restored after each call
    assert any(len(lens) > 1 for _, lens in seen)  # parallel infill of several packed slots
    assert infill_slots > 0
