"""The knob logits_chunk: llada, fast_dllm and dream (common.streamed_proposal), refusion and d2f (heads.Heads) make a
greedy step's logits at the positions it decides only, ``chunk`` positions at a time, by default. Their LM head
then multiplies fewer rows than the model's own forward, which a BLAS may round differently in a logit's last bit
(docs/design.md §6, scripts/matmul_rows.py). So on the committed trained checkpoints (float32 and bfloat16, a left-padded batch and one
row, chunks of the default and 1) each streamed step is checked against the model's own forward on the same hidden
states: the logits must agree within rounding (the float32 error bound of a dot product in any order, plus one unit
in the last place of their dtype). The decode must then give the tokens and forwards of the decode with logits_chunk
none, unless some step's (token, confidence) differ from those the full forward's logits give: a proven float tie
(the same inputs, logits within rounding, the decodes identical up to that step), which the test names in a warning,
as the reference tests do and `make test-cpus` collects. Marked ``reference``: `make test-cpus` runs it under other
instruction sets and thread counts.
"""

import copy
import warnings

import pytest
import torch

from refusion.decoding import DECODERS, common
from refusion.decoding.knobs import LOGITS_CHUNK
from refusion.tokenizer import encode_chat

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.reference]

QUERIES = ("Ana has 85 apples. Ana uses 22 apples. Then Ana gives 45 apples to Lily. How many apples does Ana have "
           "now?", "What is 3 plus 4?", "def add(a, b): return a + b. What does add(2, 5) return?")
CASES = {  # checkpoint -> (decoder, knobs)
    "mdm": [("llada", dict(block_length=16)), ("fast_dllm", dict(block_length=16)),
            ("fast_dllm", dict(block_length=16, cache="prefix")), ("fast_dllm", dict(block_length=16, cache="none"))],
    "dream": [("dream", {}), ("fast_dllm", dict(block_length=16, shift=True))],
}
# refusion's and d2f's answers carry their logits as heads.Heads, made on demand (greedy_at, prob_at)
HEADS_CASES = [("refusion", {}), ("refusion", dict(kv_layout="replicated")), ("refusion", dict(no_cache=True)),
               ("refusion", dict(slot_threshold=0.5, token_threshold=0.2)),
               ("refusion", dict(serial_num_blocks=2, slot_size=4)),
               ("d2f", dict(block_size=8)), ("d2f", dict(block_size=8, no_cache=True)),
               ("d2f", dict(block_size=8, shift=True)), ("d2f", dict(block_size=4, skip_threshold=0.5))]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint, left_pad):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for name in (*CASES, "refusion", "d2f"):
        tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint(name)))
        model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint(name))).eval()
        rows = [torch.tensor(encode_chat(tok, q)) for q in QUERIES]
        out[name] = (model, rows, left_pad(rows, pad=model.config.pad_token_id))
    return out


def checked_streaming(monkeypatch, model, steps: list):
    """Wrap common.streamed_proposal: each call also makes the model's own logits of the same positions from the
    same hidden states (the full product over every position, as forward() takes them) and appends to ``steps``
    whether ``step`` gives the same (token, confidence) on both; asserts the logits agree within rounding."""
    original = common.streamed_proposal
    eps = torch.finfo(model.dtype).eps

    def wrapped(model_, meter, phase, input_ids, keep, chunk, step, **call):
        chunks, hidden = [], []
        hook = model_.get_decoder().register_forward_hook(lambda _m, _a, out: hidden.append(out.last_hidden_state))
        try:
            got = original(model_, meter, phase, input_ids, keep, chunk,
                           lambda lg: (chunks.append(lg.clone()), step(lg))[1], **call)
        finally:
            hook.remove()
        head = model_.get_output_embeddings()
        full = head(hidden[0])[:, keep].float()  # [B, k, V]
        streamed = torch.cat(chunks, 1)
        # Within rounding: a float32 dot product of H terms summed in any order lies within H * eps32 * sum |h w|
        # of the exact one; rounding the result to the model's dtype adds a unit in its last place on each side.
        h = hidden[0][:, keep].float()
        bound = (h.abs() @ head.weight.float().abs().T) * (h.shape[-1] * torch.finfo(torch.float32).eps)
        tol = bound + 2 * eps * torch.maximum(full.abs(), streamed.abs())
        assert bool(((streamed - full).abs() <= tol).all()), (phase, (streamed - full).abs().max())
        want = step(full)
        steps.append(all(torch.equal(a, b) for a, b in zip(got, want)))
        return got

    monkeypatch.setattr(common, "streamed_proposal", wrapped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name,decoder,knobs", [(n, d, k) for n, cases in CASES.items() for d, k in cases],
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{a}={b}" for a, b in v.items()))
def test_streamed_logits_give_the_tokens_of_the_full_forward(monkeypatch, loaded, name, decoder, knobs, dtype):
    model, rows, (ids, mask) = loaded[name]
    model = copy.deepcopy(model).to(dtype)
    if dtype == torch.bfloat16:
        # Eager attention: under `make test-cpus`'s ATEN_CPU_CAPABILITY caps on an AVX-512 machine, SDPA's bfloat16
        # CPU kernel packs for VNNI by the CPU it finds and then refuses the capped ATen ("pack_vnni2 is only
        # supported when avx512 is supported"); a CPU that lacks AVX-512 takes another path. The head is the same.
        model.set_attn_implementation("eager")
    special = dict(mask_token_id=model.config.mask_token_id, eos_token_id=model.config.eos_token_id)

    def run(x, m, chunk):
        return DECODERS[decoder](model, x, attention_mask=m, gen_length=32, logits_chunk=chunk, **special, **knobs)

    full, full_stats = run(ids, mask, None)
    alone, alone_stats = run(rows[0][None], None, None)
    steps: list[bool] = []
    checked_streaming(monkeypatch, model, steps)
    for chunk, x, m, want, want_stats in ((LOGITS_CHUNK, ids, mask, full, full_stats), (1, ids, mask, full, full_stats),
                                          (LOGITS_CHUNK, rows[0][None], None, alone, alone_stats)):
        steps.clear()
        got, stats = run(x, m, chunk)
        assert steps, "the decode streamed no step"
        if all(torch.equal(a, b) for a, b in zip(want, got)) and stats["nfe"] == want_stats["nfe"]:
            continue
        # A different decode needs a step that decided otherwise: with every step's (token, confidence) equal, the
        # decode is the full forward's, step by step, so this would be a bug and not rounding.
        assert not all(steps), (chunk, want, got)
        warnings.warn(f"float tie: {decoder} {knobs} {str(dtype).removeprefix('torch.')}, batch {x.shape[0]}, "
                      f"logits_chunk {chunk}: other tokens after step {steps.index(False) + 1} of {len(steps)}, whose "
                      "token or confidence differ on logits within rounding of the full forward's")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("decoder,knobs", HEADS_CASES,
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{a}={b}" for a, b in v.items()) or "default")
def test_heads_streamed_logits_give_the_tokens_of_the_full_forward(loaded, decoder, knobs, dtype):
    """refusion and d2f with logits_chunk (the default and 1) against none: the same tokens, forwards and commit
    log, for a left-padded batch and one row (asserted: no float tie met here; the step-by-step proof above is for
    the decoders whose steps go through common.streamed_proposal)."""
    model, rows, (ids, mask) = loaded[decoder]
    model = copy.deepcopy(model).to(dtype)
    if dtype == torch.bfloat16:
        model.set_attn_implementation("eager")  # as above: SDPA's bfloat16 kernel under the capped ATen

    def run(x, m, chunk):
        return DECODERS[decoder](model, x, attention_mask=m, gen_length=32, logits_chunk=chunk, **knobs)

    for x, m in ((ids, mask), (rows[0][None], None)):
        want, want_stats = run(x, m, None)
        for chunk in (LOGITS_CHUNK, 1):
            got, stats = run(x, m, chunk)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), (chunk, want, got)
            assert (stats["nfe"], stats["commit_forward"]) == (want_stats["nfe"], want_stats["commit_forward"])
