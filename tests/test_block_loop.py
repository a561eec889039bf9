"""The block decoders share one loop (refusion/decoding/block_loop.py): the block-diffusion decoders and the
semi-autoregressive masked-diffusion ones (``BLOCK_DECODERS`` below) are step rules (``BlockRule``) with no loop of
their own, decoded by ``decode_blocks``, which lays every row on its own block grid and drops the rows that ended
(the masked-diffusion rules keep every row until none goes on). And no function of refusion/decoding is longer
than a page (80 lines, as test_layering.py asks of harness)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from refusion.decoding import DECODERS
from refusion.decoding.block_loop import BlockGrid, BlockRule, BlockRun

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "tests" / "fixtures" / "released"
MAX_FUNCTION_LINES = 80
# decoder -> its release-layout fixture folder
BLOCK_DECODERS = {"sdar": "sdar", "llada2": "llada2", "diffusion_gemma": "diffusiongemma", "llada": "llada",
                  "fast_dllm": "llada", "dream": "dream_base"}


def test_the_grid_lays_blocks_on_absolute_positions_or_after_the_prompt():
    aligned = BlockGrid.lay([5, 8, 3], size=4, gen_length=6, aligned=True)
    assert aligned.starts == [4, 8, 0]  # the first decoded block holds the prompt's last length % size tokens
    assert aligned.blocks == [2, 2, 3]  # whole blocks up to prompt + gen_length, rounded up
    after = BlockGrid.lay([5, 8, 3], size=4, gen_length=6, aligned=False)
    assert after.starts == [5, 8, 3] and after.blocks == [2, 2, 2]


@pytest.mark.parametrize("decoder", sorted(BLOCK_DECODERS))
def test_the_decoder_is_a_step_rule_of_the_shared_loop(decoder):
    module = inspect.getmodule(DECODERS[decoder].fn)
    rules = [c for c in vars(module).values() if inspect.isclass(c) and issubclass(c, BlockRule) and c is not BlockRule
             and c.__module__ == module.__name__]
    assert rules, f"{module.__name__} defines no step rule"
    source = inspect.getsource(DECODERS[decoder].fn)
    assert "decode_blocks(" in source and any(f"{r.__name__}(" in source for r in rules)
    for r in rules:  # a rule has no loop over blocks of its own: decide() is one block
        assert "for j in range" not in inspect.getsource(r)


@pytest.mark.parametrize("decoder", sorted(BLOCK_DECODERS))
def test_each_block_decoder_goes_through_the_shared_loop(decoder, left_pad, monkeypatch):
    from harness.models.checkpoints import load_model

    m = load_model(ROOT / BLOCK_DECODERS[decoder])
    begun: list[tuple[int, list[int]]] = []
    real = BlockRun.begin

    def spy(self, j, positions=True):
        begun.append((j, list(self.live)))
        return real(self, j, positions)

    monkeypatch.setattr(BlockRun, "begin", spy)
    rows = [torch.tensor(m.tokenizer.encode(text)) for text in ("Hello there, how are you?", "Two plus two")]
    ids, mask = left_pad(rows, m.tokenizer.pad_token_id or 0)
    knobs = {"gen_length": 8, **({"block_length": 4} if "block_length" in DECODERS[decoder].knobs.names()
                                 and DECODERS[decoder].masked_diffusion else {})}  # divides 8
    tokens, stats = DECODERS[decoder](m.model, ids, mask, knobs)
    assert len(tokens) == 2 and stats["nfe"] > 0
    assert begun and begun[0] == (0, [0, 1])  # every row starts in the loop's first block
    assert [j for j, _ in begun] == list(range(len(begun)))  # one block after the other
    assert all(set(later) <= set(earlier) for (_, earlier), (_, later) in zip(begun, begun[1:]))  # rows only leave


def test_no_function_of_the_decoders_is_over_80_lines():
    long = []
    for path in sorted((REPO / "refusion" / "decoding").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not long, long
