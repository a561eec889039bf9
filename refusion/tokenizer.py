"""Byte-level BPE tokenizer for the tiny models, saved as a Hugging Face folder.

Byte-level means every UTF-8 string encodes and decodes back exactly (real
benchmark prompts included). Digits are split one per token before BPE, as
Qwen3 does, so arithmetic is learnable by a small model. Special tokens follow
docs/design.md §2 (begin-of-text and mask added) plus Qwen-style chat roles; the EOS of
a response is ``<|im_end|>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = {
    "pad_token": "<|endoftext|>",
    "bos_token": "<|bos|>",
    "eos_token": "<|im_end|>",
    "mask_token": "<|mask|>",
}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

# One turn per message, each closed by the EOS token; the generation prompt opens
# an assistant turn. Tokens in, tokens out: decoders never see this text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 1024  # at most 4096: a tiny model spends few parameters on embeddings
    min_frequency: int = 2


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig = TokenizerConfig()):
    """Train the byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not 256 < cfg.vocab_size <= 4096:
        raise ValueError(f"vocab_size must be in (256, 4096], got {cfg.vocab_size}")
    specials = list(SPECIAL_TOKENS.values()) + ROLE_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, additional_special_tokens=ROLE_TOKENS, clean_up_tokenization_spaces=False,
        **SPECIAL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    return fast


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_chat(tokenizer, query: str) -> list[int]:
    """Prompt ids: the chat-templated user turn plus the assistant generation prompt."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": query}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
        ids = ids["input_ids"]
    return list(ids)


def encode_response(tokenizer, response: str) -> list[int]:
    """Response ids followed by the EOS token (docs/design.md §2 step 1)."""
    return tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
