"""Embedded task suite, tokenizer, an overfit run and training determinism."""

import copy
import random

import pytest
import torch

from refusion import objective as obj
from refusion.tokenizer import (CHAT_TEMPLATE, SPECIAL_TOKENS, TokenizerConfig, encode_chat, encode_response,
                                train_tokenizer)
from tasks.embedded import KINDS, load_split


@pytest.mark.parametrize("kind", KINDS)
def test_splits_sizes_disjoint_and_deterministic(kind):
    test, train = load_split(kind, "test"), load_split(kind, "train")
    assert len(test) >= 300 and len(train) >= 5000
    assert not {r["query"] for r in test} & {r["query"] for r in train}
    assert len({r["id"] for r in test + train}) == len(test) + len(train)
    from tasks import embedded

    again = embedded._generate(kind, "test", 50, embedded.SPLIT_SEEDS["test"], frozenset())
    assert [r["query"] for r in again] == [r["query"] for r in test[:50]]
    for r in test[:50]:
        assert set(r) >= {"id", "kind", "query", "response", "answer"}


def test_item_formats():
    m = load_split("math", "test")[0]
    assert m["response"].endswith(f"#### {m['answer']}")
    c = load_split("choice", "test")[0]
    assert c["response"].endswith(f"The answer is ({c['answer']})")
    code = load_split("code", "test")[0]
    assert code["response"].startswith(f"def {code['entry_point']}(") and len(code["tests"]) == 3


def test_embedded_reference_answers_pass_their_tests():
    # The asserts were computed from the template semantics; the reference code must agree.
    from tasks.scoring import score_many

    rows = load_split("code", "test")[:40]
    scores = score_many("embedded_code", [r["response"] for r in rows], rows)
    assert all(next(iter(s.values())) == 1.0 for s in scores)


@pytest.fixture(scope="module")
def small_tokenizer():
    texts = [t for k in KINDS for r in load_split(k, "test") for t in (r["query"], r["response"])]
    return train_tokenizer(texts, TokenizerConfig(vocab_size=400))


def test_tokenizer_special_tokens_and_chat(small_tokenizer, tmp_path):
    tok = small_tokenizer
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in SPECIAL_TOKENS.items()}
    assert len(set(ids.values())) == len(ids) and tok.mask_token_id == ids["mask_token"]
    assert len(tok) <= 4096
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.chat_template == CHAT_TEMPLATE
    assert encode_chat(again, "What is 2 + 2?") == encode_chat(tok, "What is 2 + 2?")
    prompt = encode_chat(tok, "hi")
    assert prompt[0] == tok.bos_token_id and tok.decode(prompt).endswith("<|assistant|>\n")
    assert encode_response(tok, "4")[-1] == tok.eos_token_id


def test_tokenizer_round_trips_random_unicode(small_tokenizer):
    rng = random.Random(0)
    pools = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x0600, 0x06FF)]
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 60)):
            lo, hi = rng.choice(pools)
            chars.append(chr(rng.randint(lo, hi)) if rng.random() > 0.1 else rng.choice(" \n\t  "))
        text = "".join(chars)
        assert small_tokenizer.decode(small_tokenizer.encode(text, add_special_tokens=False)) == text


def test_digits_are_single_tokens(small_tokenizer):
    toks = small_tokenizer.tokenize("123 + 4567")
    assert [t for t in toks if any(ch.isdigit() for ch in t)] == list("1234567")


@pytest.mark.parametrize("name", ["refusion", "ar", "mdm"])
def test_overfit_lowers_loss(name, small_tokenizer, one_thread):
    """A short overfit run (40 steps, a few seconds on one thread) on 8 examples lowers each objective's loss
    (to 0.46-0.50 of its start; a fixed step count, never a time limit: the result must not depend on the
    machine's speed)."""
    from transformers import Qwen3ForCausalLM

    from refusion.train import ModelShape, TrainConfig, make_batch, make_config

    torch.manual_seed(0)
    tok = small_tokenizer
    rows = load_split("math", "test")[:8]
    examples = [obj.Example(encode_chat(tok, r["query"]), encode_response(tok, r["response"])) for r in rows]
    shape = ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    model = Qwen3ForCausalLM._from_config(copy.deepcopy(make_config(tok, shape, name)), attn_implementation="sdpa")
    cfg = TrainConfig(batch_size=8, lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    fixed = [make_batch(name, {"math": examples}, s, cfg, tok) for s in range(4)]  # the same few masks, reused

    def mean_loss():
        with torch.no_grad():
            return sum(float(obj.OBJECTIVES[name](model, b)) for b in fixed) / len(fixed)

    before = mean_loss()
    for step in range(40):
        loss = obj.OBJECTIVES[name](model, fixed[step % len(fixed)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = mean_loss()
    assert after < 0.6 * before, (before, after)


def test_training_is_deterministic(small_tokenizer, tmp_path):
    """Same seed, same machine: the same final loss (to 4 decimals, as `make train-tiny` promises)."""
    import json

    from refusion.train import ModelShape, TrainConfig, train_one

    tok = small_tokenizer
    rows = {k: load_split(k, "test")[:16] for k in KINDS}
    examples = {k: [obj.Example(encode_chat(tok, r["query"]), encode_response(tok, r["response"])) for r in v]
                for k, v in rows.items()}
    shape = ModelShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16)
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup=2, threads=1, save_every=3)

    def final_loss(out):
        train_one("ar", tok, examples, cfg, shape, out, progress=False)
        log = (out / "ar" / "train_log.csv").read_text().splitlines()
        assert len(log) == 1 + cfg.steps and not (out / ".ar.state.pt").exists()
        return json.loads((out / "ar" / "train_config.json").read_text())["final_loss"]

    a, b = final_loss(tmp_path / "a"), final_loss(tmp_path / "b")
    assert round(a, 4) == round(b, 4)
