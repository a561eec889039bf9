"""Log-likelihood scoring of the lm-eval model (``harness/run/lm_adapter.py``): exact for causal
checkpoints; for bidirectional ones the Monte-Carlo estimate LLaDA uses (module docstring of lm_adapter)."""

from __future__ import annotations

import torch


@torch.no_grad()
def causal_loglikelihood(model, device, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's token log-probs, whether greedy decoding gives it) from one forward."""
    ids = torch.tensor([ctx + cont], dtype=torch.long, device=device)
    logits = model(input_ids=ids[:, :-1]).logits.float()[0, len(ctx) - 1:]
    logp = torch.log_softmax(logits, -1)
    target = torch.tensor(cont, device=device)
    ll = float(logp.gather(-1, target[:, None]).sum())
    greedy = bool((logp.argmax(-1) == target).all())
    return ll, greedy


@torch.no_grad()
def mdm_loglikelihood(model, device, mask_id: int, ctx: list[int], cont: list[int], *, seed: int, mc_num: int,
                      mc_batch: int) -> tuple[float, bool]:
    """Monte-Carlo estimate over ``mc_num`` draws (mask counts stratified over [1, L], each masked token
    scored at its own position, weighted by L / count); greedy: fill the masked continuation one most
    confident position at a time and compare. ``seed`` seeds the draws."""
    n_ctx, L = len(ctx), len(cont)
    seq = torch.tensor(ctx + cont, dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(seed)
    draws = max(mc_num, 1)
    total, done = 0.0, 0
    while done < draws:
        b = min(mc_batch, draws - done)
        # Stratified mask counts: evenly spaced over [1, L] from a random start, so a
        # small batch still covers light and heavy masking (lower variance than iid counts).
        start = int(torch.randint(1, L + 1, (1,), generator=gen))
        counts = [((start - 1 + round(j * L / b)) % L) + 1 for j in range(b)]
        batch = seq.repeat(b, 1)
        masked = torch.zeros(b, n_ctx + L, dtype=torch.bool)
        for r, c in enumerate(counts):
            pos = torch.randperm(L, generator=gen)[:c] + n_ctx
            masked[r, pos] = True
        masked = masked.to(device)
        batch[masked] = mask_id
        logp = torch.log_softmax(model(input_ids=batch).logits.float(), -1)
        tok_ll = logp.gather(-1, seq.repeat(b, 1)[..., None])[..., 0]
        w = torch.tensor([L / c for c in counts], device=device)
        total += float(((tok_ll * masked).sum(-1) * w).sum())
        done += b
    return total / draws, _greedy_fill_matches(model, seq, n_ctx, mask_id)


def _greedy_fill_matches(model, seq: torch.Tensor, n_ctx: int, mask_id: int) -> bool:
    """Unmask the most confident position one at a time; whether the result is the continuation."""
    x = seq.clone()
    x[n_ctx:] = mask_id
    target = seq[n_ctx:]
    for _ in range(len(seq) - n_ctx):
        probs = torch.softmax(model(input_ids=x[None]).logits.float()[0, n_ctx:], -1)
        conf, pred = probs.max(-1)
        still = x[n_ctx:] == mask_id
        conf = torch.where(still, conf, torch.full_like(conf, -1.0))
        j = int(conf.argmax())
        x[n_ctx + j] = pred[j]
    return bool((x[n_ctx:] == target).all())


class Scorer:
    """Log-likelihoods on one loaded checkpoint, as the lm-eval model answers its loglikelihood requests."""

    def __init__(self, model, device, *, causal: bool, mask: int | None, pretrained: str, seed: int, mc_num: int,
                 mc_batch: int, refuse: str | None = None) -> None:
        self.model, self.device, self.causal, self.mask, self.pretrained = model, device, causal, mask, pretrained
        self.seed, self.mc_num, self.mc_batch = seed, mc_num, mc_batch
        self.refuse = refuse  # why this checkpoint scores nothing (a block-diffusion model's forward is no LM's)

    def mask_id(self) -> int:
        if self.mask is None:
            raise ValueError(f"checkpoint {self.pretrained!r} is bidirectional but names no mask_token_id")
        return self.mask

    def score(self, ctx: list[int], cont: list[int], key: str) -> tuple[float, bool]:
        """(log-likelihood, is greedy) of one continuation; ``key`` (the request's) seeds the draws."""
        if self.refuse:
            raise ValueError(self.refuse)
        if not cont:
            return 0.0, True
        if self.causal:
            return causal_loglikelihood(self.model, self.device, ctx, cont)
        return mdm_loglikelihood(self.model, self.device, self.mask_id(), ctx, cont,
                                 seed=int(key[:8], 16) ^ self.seed, mc_num=self.mc_num, mc_batch=self.mc_batch)

    def rolling(self, ids: list[int], prefix: int) -> float:
        """Log-likelihood of a whole text over lm-eval's rolling windows (causal checkpoints only)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        if self.refuse:
            raise ValueError(self.refuse)

        max_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        total = 0.0
        for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(ids, prefix, max_len, 1)):
            total += causal_loglikelihood(self.model, self.device, list(ctx), list(cont))[0]
        return total
