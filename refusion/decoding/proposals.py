"""Proposals: a token and its probability at given positions, greedy or sampled, from logits or from
probabilities (``propose``, the one name of that step: the decoders' own rules are ``<decoder>_propose``, and
SDAR's ``draw``); the seeded generator a decoder samples with; float32 rounding of host-side thresholds."""

from __future__ import annotations

import torch

from .tokens import id_tensor


def propose(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None, exclude: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (token [...], its probability [...]).

    Greedy (temperature 0): argmax and its softmax probability. Otherwise a sample
    from softmax(logits / temperature) and the sampled token's tempered probability.
    `exclude`: see `propose_from_probs`.
    """
    probs = torch.softmax(logits / temperature if temperature > 0 else logits, dim=-1)
    return propose_from_probs(probs, temperature > 0, generator, exclude)


def propose_from_probs(
    probs: torch.Tensor, sample: bool, generator: torch.Generator | None, exclude: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [..., V] -> (token [...], its probability [...]): the most likely token, or a sample.

    `exclude`: a token id never returned -- the mask id, for the masked-diffusion decoders: a
    position "unmasked" to the mask id would stay masked and be decoded again forever (a
    random test model does propose it). Its probability still counts in the others'
    (the returned probability is unchanged), so greedy decoding of a model that never ranks
    it first is exactly as without the exclusion; sampling draws from the other tokens.
    """
    if not sample:
        conf, tok = probs.max(dim=-1)
        if exclude is None or not bool((tok == exclude).any()):
            # max returns the first maximal index, as argmax does: the exclusion below changes nothing here
            return tok, conf
        tok = probs.index_fill(-1, id_tensor((exclude,), probs.device), -1.0).argmax(-1)
    else:
        flat = probs.reshape(-1, probs.shape[-1])
        if exclude is not None:
            flat = flat.index_fill(-1, id_tensor((exclude,), probs.device), 0.0)
        tok = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    return tok, probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def token_prob(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int = 64) -> torch.Tensor:
    """Probability of `tokens` [n, ...] under logits [n, ..., V] (tempered when sampling), computed for about
    `rows` positions at a time along the first dimension: each position's softmax is its own, so the values are
    those of one call over all, with at most [rows, V] probabilities alive."""
    scale = temperature if temperature > 0 else 1.0
    step = max(1, rows // max(1, tokens[:1].numel()))  # leading entries per chunk
    return torch.cat([torch.softmax(logits[i:i + step] / scale, dim=-1).gather(-1, tokens[i:i + step].unsqueeze(-1))
                      .squeeze(-1) for i in range(0, tokens.shape[0], step)]) if tokens.numel() else tokens.float()


def make_generator(device: torch.device, seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def as_float32(value: float) -> float:
    """``value`` rounded to float32, as a Python float: a float32 tensor compared with a Python number is
    compared in float32, so host-side comparisons of confidences read from such a tensor use this."""
    return torch.tensor(value, dtype=torch.float32).item()
