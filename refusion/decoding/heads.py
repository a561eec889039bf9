"""A forward's logits, made when a step asks for them (``Heads``), and the two questions ReFusion's steps ask of
them in chunks of positions: the greedy token and its probability (``greedy_at``), and the probability of given
tokens (``prob_at``). With the knob logits_chunk a step never holds more than one chunk of [chunk, V] logits;
made by ``common.forward_heads`` (docs/design.md §6, "Logits at a step")."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .proposals import propose, token_prob


class Heads:
    """The float32 logits [U, n, V] of a forward's read query positions (U rows, n positions), made when asked for.

    Either ``dense``: the float32 logits themselves (the model's forward made them: logits_chunk none, sampling,
    compiled forwards); or ``hidden`` [U, n, H], the backbone's last hidden states, with the model's LM head
    ``head``: ``at`` then runs the head on the asked positions only, and ``check`` (common.check_finite) refuses
    logits that are not finite. Positions are flat, row-major indices into U x n."""

    def __init__(self, *, dense: torch.Tensor | None = None, hidden: torch.Tensor | None = None, head=None,
                 check: Callable[[torch.Tensor], None] | None = None):
        self.dense, self.hidden, self.head, self.check = dense, hidden, head, check

    @property
    def shape(self) -> tuple[int, int]:
        """(U, n)."""
        t = self.dense if self.dense is not None else self.hidden
        return t.shape[0], t.shape[1]

    def part(self, rows: slice, cols: slice) -> Heads:
        """The same logits of rows ``rows`` and positions ``cols`` (views, nothing made)."""
        if self.dense is not None:
            return Heads(dense=self.dense[rows, cols])
        return Heads(hidden=self.hidden[rows, cols], head=self.head, check=self.check)

    def shifted(self, first: torch.Tensor) -> Heads:
        """The logits of the positions one later (Dream-based models: the logit at i - 1 predicts token i): position
        0 answers with ``first`` [U, D] (a row as ``raw`` gives it), position j with this one's j - 1. A copy of
        what this holds ([U, n, V] dense, [U, n, H] hidden), as a shifted dense tensor always was."""
        if self.dense is not None:
            return Heads(dense=torch.cat([first[:, None], self.dense[:, :-1]], 1))
        return Heads(hidden=torch.cat([first[:, None], self.hidden[:, :-1]], 1), head=self.head, check=self.check)

    def raw(self, j: int) -> torch.Tensor:
        """A copy of position j's rows [U, D] of what this holds: float32 logits (dense) or hidden states, which
        ``shifted`` takes as its first position (a copy, so the rest of this forward's tensor is not kept)."""
        return (self.dense if self.dense is not None else self.hidden)[:, j].clone()

    def at(self, idx: torch.Tensor | slice) -> torch.Tensor:
        """float32 logits [k, V] of the flat positions ``idx`` (an index tensor [k] or a slice with a stop). Rows
        and positions are picked apart (``_pick``), so a part of a stacked call is never copied whole; a slice
        of one row's dense logits is a view, as the decoders sliced them before."""
        if self.dense is not None:
            return _pick(self.dense, idx)
        logits = self.head(_pick(self.hidden, idx)).float()  # [k, V]
        self.check(logits[None])
        return logits

    def all(self) -> torch.Tensor:
        """float32 logits [U, n, V] of every position (a sampled step draws over all of them at once)."""
        if self.dense is not None:
            return self.dense
        u, n = self.shape
        return self.at(torch.arange(u * n, device=self.hidden.device)).view(u, n, -1)


def _pick(t: torch.Tensor, idx: torch.Tensor | slice) -> torch.Tensor:
    """Rows [k, D] of t [U, n, D] at the flat positions ``idx`` (row-major into U x n)."""
    n = t.shape[1]
    if isinstance(idx, slice):
        if t.shape[0] == 1:
            return t[0, idx]
        idx = torch.arange(idx.start or 0, idx.stop, device=t.device)
    return t[idx // n, idx % n]


def chunks(idx: torch.Tensor | slice, chunk: int | None) -> list:
    """``idx`` (an index tensor, or a slice with a stop) cut into pieces of ``chunk`` positions (None: one)."""
    if isinstance(idx, slice):
        start, stop = idx.start or 0, idx.stop
        step = max(stop - start, 1) if chunk is None else chunk
        return [slice(i, min(i + step, stop)) for i in range(start, stop, step)]
    step = max(idx.numel(), 1) if chunk is None else chunk
    return [idx[i:i + step] for i in range(0, idx.numel(), step)]


def _count(part) -> int:
    return part.stop - part.start if isinstance(part, slice) else part.numel()


def greedy_at(heads: Heads, idx: torch.Tensor | slice, chunk: int | None,
              exclude: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [k], probability [k]) of the greedy pick at the flat positions ``idx`` (``propose`` at temperature
    0, never the token ``exclude``: each position's softmax is its own, so chunks give the values of one call),
    ``chunk`` positions at a time (None: all at once)."""
    picks = [propose(heads.at(part), 0.0, None, exclude) for part in chunks(idx, chunk)]
    if not picks:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    return torch.cat([t for t, _ in picks]), torch.cat([p for _, p in picks])


def prob_at(heads: Heads, idx: torch.Tensor | slice, tokens: torch.Tensor, temperature: float,
            chunk: int | None) -> torch.Tensor:
    """Probability [k] of ``tokens`` [k] at the flat positions ``idx`` (``token_prob``: tempered when sampling),
    ``chunk`` positions at a time (None: all at once)."""
    out, i = [], 0
    for part in chunks(idx, chunk):
        n = _count(part)
        out.append(token_prob(heads.at(part), tokens[i:i + n], temperature))
        i += n
    return torch.cat(out) if out else tokens.float()
