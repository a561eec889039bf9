"""ReFusion plan-and-infill decoder with full KV reuse (DESIGN §3), and its ablations
as modes of the same function: left_to_right, recompute_kv, no_cache.

State of one row (`_Row`): the committed sequence in commit order (ids, true position
ids) and, for every committed token, which earlier committed tokens it attended to
when its KV was computed: commit indices [0, base) plus [start, itself]. Prompt and
global-verify tokens are causal (base = start = 0); a slot infilled in parallel saw
the cache as it stood at the start of its round (base = that length) plus its own
earlier tokens (start = its first commit index). The KV cache holds exactly those
tokens' KV, in commit order. `no_cache` keeps the same state but no cache: every
forward re-encodes the committed sequence under that recorded pattern, so tokens are
unchanged and only the cost differs.

Rows of a batch are decoded one after another (the state is per row; a batched
version would pack rows like slots).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..slot_attention import slot_visibility
from .common import (
    Meter,
    cache_append,
    cache_keep,
    cache_len,
    cache_tail,
    check_float,
    check_int,
    eos_ids,
    forward,
    is_eos,
    kv_parts_bytes,
    make_generator,
    mask_id,
    padding_mask,
    pick,
    token_prob,
)

PHASES = ("plan", "verify", "draft", "infill", "recompute")


@dataclass
class _Row:
    """Committed tokens of one row in commit order, with the pattern each was encoded under."""

    ids: list[int]
    pos: list[int]
    base: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.base = self.base or [0] * len(self.ids)
        self.start = self.start or [0] * len(self.ids)

    def add(self, ids: list[int], pos: list[int], base: int = 0, start: int = 0) -> None:
        """Append tokens that saw commit indices [0, base) and [start, themselves].

        The default (0, 0) is causal: each saw everything committed before it.
        """
        self.ids += ids
        self.pos += pos
        self.base += [base] * len(ids)
        self.start += [start] * len(ids)

    def visibility(self, device) -> torch.Tensor:
        """Bool [c, c]: committed token i attended j (j < base[i] or start[i] <= j <= i)."""
        c = len(self.ids)
        i = torch.arange(c, device=device)[:, None]
        j = torch.arange(c, device=device)[None, :]
        base = torch.tensor(self.base, device=device)[:, None]
        start = torch.tensor(self.start, device=device)[:, None]
        return (j < base) | ((j >= start) & (j <= i))


def _run(model, meter, phase, row: _Row, cache, new_ids, new_pos, slot_lens) -> torch.Tensor:
    """Forward `new_ids` [q] at `new_pos` [q] after the committed row; returns logits [q, V].

    New tokens see every committed token plus the packed-slot pattern among
    themselves (one run = causal). Committed tokens not in the cache (all of them
    under no_cache, the prompt in the first round) are re-encoded in the same call
    under their recorded pattern. After a cached call the cache holds
    committed + new; the caller trims it.
    """
    device = new_ids.device
    c, cached, q = len(row.ids), cache_len(cache), new_ids.numel()
    vis_new = slot_visibility(c, slot_lens, device)  # [q, c + q]
    if cached < c:
        vis = torch.zeros(c + q, c + q, dtype=torch.bool, device=device)
        vis[:c, :c] = row.visibility(device)
        vis[c:] = vis_new
        ids = torch.cat([torch.tensor(row.ids[cached:], device=device), new_ids])
        pos = torch.cat([torch.tensor(row.pos[cached:], device=device), new_pos])
        vis = vis[cached:]  # rows for the uncached committed tokens + new ones
    else:
        ids, pos, vis = new_ids, new_pos, vis_new
    logits = forward(model, meter, phase, ids[None], position_ids=pos[None], visible=vis, cache=cache)
    return logits[0, -q:]


@torch.no_grad()
def refusion(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    gen_length: int = 256,
    slot_size: int = 8,
    serial_num_blocks: int = 1,
    slot_threshold: float = 0.9,
    token_threshold: float = 0.4,
    temperature: float = 0.0,
    left_to_right: bool = False,
    recompute_kv: bool = False,
    no_cache: bool = False,
    seed: int | None = 0,
    mask_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    on_commit: Callable[[dict], None] | None = None,
) -> tuple[list[torch.Tensor], dict]:
    """ReFusion plan / global verify / parallel infill / commit (DESIGN §3).

    gen_length is padded up to a multiple of slot_size; the slots are cut into
    serial_num_blocks consecutive blocks (must divide the slot count). Modes:
    left_to_right -- the plan may only pick the leftmost masked slot;
    recompute_kv -- after a parallel-infill commit of >= 2 slots, their KV is
    recomputed by one causal forward over the commit order (may change tokens);
    no_cache -- no KV reuse, every forward re-encodes the committed sequence (same
    tokens). on_commit(info) is called after every commit (tests) with the row's
    committed ids / positions / base / start, the cache (None under no_cache) and
    the commit kind ("prompt", "verify", "infill", "recompute").
    Phases counted: plan, verify (global), draft and infill (infill draft / verify),
    recompute.
    """
    gen_length = check_int("gen_length", gen_length, 1)
    slot_size = check_int("slot_size", slot_size, 1)
    n_slots = -(-gen_length // slot_size)
    serial_num_blocks = check_int("serial_num_blocks", serial_num_blocks, 1, n_slots)
    if n_slots % serial_num_blocks:
        raise ValueError(
            f"serial_num_blocks must divide the slot count {n_slots} (gen_length {gen_length} / slot_size {slot_size}),"
            f" got {serial_num_blocks}"
        )
    slot_threshold = check_float("slot_threshold", slot_threshold, 0.0, 1.0)
    token_threshold = check_float("token_threshold", token_threshold, 0.0, 1.0)
    temperature = check_float("temperature", temperature, 0.0)
    mask = mask_id(model, mask_token_id)
    eos = eos_ids(model, eos_token_id)
    pad = padding_mask(input_ids, attention_mask)
    meter = Meter(model, PHASES)
    gen = make_generator(input_ids.device, seed)
    knobs = dict(
        slot_size=slot_size, n_slots=n_slots, per_block=n_slots // serial_num_blocks,
        slot_threshold=slot_threshold, token_threshold=token_threshold, temperature=temperature,
        left_to_right=left_to_right, recompute_kv=recompute_kv, no_cache=no_cache,
        mask=mask, eos=eos, gen=gen, on_commit=on_commit,
    )
    counts = {"rounds": 0, "verify_commits": 0, "infill_rounds": 0, "infill_commits": 0, "slots_parallel_max": 0}
    responses = [
        _decode_row(model, meter, row_ids[row_mask.bool()], counts, **knobs) for row_ids, row_mask in zip(input_ids, pad)
    ]
    return responses, meter.finish(responses, **counts)


def _decode_row(model, meter, prompt, counts, *, slot_size, n_slots, per_block, slot_threshold, token_threshold,
                temperature, left_to_right, recompute_kv, no_cache, mask, eos, gen, on_commit) -> torch.Tensor:
    device = prompt.device
    L, lp = slot_size, prompt.numel()
    row = _Row(ids=prompt.tolist(), pos=list(range(lp)))
    cache = None if no_cache else DynamicCache(config=model.config)
    done: dict[int, list[int]] = {}  # position -> token, committed response tokens
    eos_pos: int | None = None  # position of the first committed EOS

    def notify(kind: str) -> None:
        if on_commit is not None:
            on_commit(dict(kind=kind, ids=list(row.ids), pos=list(row.pos), base=list(row.base),
                           start=list(row.start), cache=cache))

    def slot_pos(s: int) -> torch.Tensor:
        return torch.arange(lp + s * L, lp + (s + 1) * L, device=device)

    def commit(tokens: list[int], positions: list[int], base: int = 0, start: int = 0) -> None:
        nonlocal eos_pos
        row.add(tokens, positions, base, start)
        for t, p in zip(tokens, positions):
            done[p] = t
            if t in eos and (eos_pos is None or p < eos_pos):
                eos_pos = p

    for b in range(n_slots // per_block):
        masked = list(range(b * per_block, (b + 1) * per_block))
        while masked:
            if eos_pos is not None:  # drop slots after the first EOS (here and in later blocks)
                masked = [s for s in masked if lp + s * L < eos_pos]
                if not masked:
                    break
            counts["rounds"] += 1
            c = len(row.ids)
            # 1. Plan: every masked slot of the block as mask tokens at true positions, causal after the row.
            plan_pos = torch.cat([slot_pos(s) for s in masked])  # [m * L]
            logits = _run(model, meter, "plan", row, cache, torch.full_like(plan_pos, mask), plan_pos,
                          [plan_pos.numel()])
            if cache is not None:
                cache_keep(cache, c)  # keep committed KV (incl. the prompt on round one), drop the masks'
            tok, conf = pick(logits, temperature, gen)
            tok, conf = tok.view(len(masked), L), conf.view(len(masked), L)
            if left_to_right:
                picked = [0]
            else:
                picked = (conf[:, 0] > slot_threshold).nonzero().flatten().tolist() or [int(conf[:, 0].argmax())]
            slots = [masked[i] for i in picked]  # position order
            drafts = tok[picked].clone()  # [k, L]
            k = len(slots)

            # 2. Global verify: the drafts concatenated, causal after the row.
            stream, stream_pos = drafts.flatten(), torch.cat([slot_pos(s) for s in slots])
            logits = _run(model, meter, "verify", row, cache, stream, stream_pos, [k * L])
            ok = torch.ones(k * L, dtype=torch.bool, device=device)
            ok[1:] = token_prob(logits[:-1], stream[1:], temperature) > token_threshold
            ok[::L] = True  # a slot's first token is always accepted
            n_acc = int(ok.long().cumprod(0).sum())
            hits = is_eos(stream[:n_acc], eos).nonzero()
            n_commit = int(hits[0, 0]) + 1 if hits.numel() else (n_acc // L) * L
            if n_commit:
                if cache is not None:
                    cache_keep(cache, c, torch.arange(n_commit, device=device))
                commit(stream[:n_commit].tolist(), stream_pos[:n_commit].tolist())  # causal
                counts["verify_commits"] += 1
                committed = {slots[i // L] for i in range(n_commit)}
                masked = [s for s in masked if s not in committed]
                notify("verify")
                continue
            if cache is not None:
                cache_keep(cache, c)

            # 3. Parallel infill: each picked slot its own run after the shared row (packed, one read of the prefix).
            counts["slots_parallel_max"] = max(counts["slots_parallel_max"], k)
            accepted = [1] * k
            accepted[0] = max(1, n_acc)  # slot 0's stream prefix was verified in exactly its infill context
            alive = list(range(k))  # indices into slots, position order
            finished: dict[int, int] = {}  # slot index -> accepted length
            kv_store: dict[int, list] = {}
            for _ in range(L):
                if not alive:
                    break
                counts["infill_rounds"] += 1
                todo = [i for i in alive if accepted[i] < L]
                if todo:  # draft: not-yet-accepted tokens as masks, predictions at those positions
                    ids = drafts[todo].clone()
                    for r, i in enumerate(todo):
                        ids[r, accepted[i]:] = mask
                    pos = torch.cat([slot_pos(slots[i]) for i in todo])
                    logits = _run(model, meter, "draft", row, cache, ids.flatten(), pos, [L] * len(todo))
                    new, _ = pick(logits.view(len(todo), L, -1), temperature, gen)
                    for r, i in enumerate(todo):
                        drafts[i, accepted[i]:] = new[r, accepted[i]:]
                    if cache is not None:
                        cache_keep(cache, c)
                # verify: each alive slot's draft, causal inside the slot; longest confident prefix.
                pos = torch.cat([slot_pos(slots[i]) for i in alive])
                logits = _run(model, meter, "infill", row, cache, drafts[alive].flatten(), pos, [L] * len(alive))
                logits = logits.view(len(alive), L, -1)
                stop_after: int | None = None
                for r, i in enumerate(alive):
                    probs = token_prob(logits[r, :-1], drafts[i, 1:], temperature)  # [L-1], token j from j-1
                    n = min(accepted[i] + 1, L)  # the first not-yet-accepted token is always accepted
                    while n < L and bool(probs[n - 1] > token_threshold):
                        n += 1
                    accepted[i] = n
                    hit = is_eos(drafts[i, :n], eos).nonzero()
                    if hit.numel():
                        accepted[i] = int(hit[0, 0]) + 1
                        stop_after = i
                    if cache is not None:
                        kv_store[i] = cache_tail(cache, c, r * L + torch.arange(accepted[i], device=device))
                    if accepted[i] == L or hit.numel():
                        finished[i] = accepted[i]
                    if stop_after is not None:
                        break
                if stop_after is not None:  # an accepted EOS drops every later slot
                    finished = {i: n for i, n in finished.items() if i <= stop_after}
                    kv_store = {i: kv for i, kv in kv_store.items() if i <= stop_after}
                alive = [i for i in alive if i not in finished and (stop_after is None or i < stop_after)]
                if cache is not None:
                    meter.kv(cache, extra=kv_parts_bytes(kv_store.values()))
                    cache_keep(cache, c)
            assert not alive, "infill must finish within slot_size rounds"

            # 4. Commit finished slots in slot order, each with the KV computed at its true positions.
            order = sorted(finished)
            first = c
            for i in order:
                n = finished[i]
                commit(drafts[i, :n].tolist(), slot_pos(slots[i])[:n].tolist(), base=c, start=first)
                first += n
            if cache is not None:
                cache_append(cache, [kv_store[i] for i in order])
            counts["infill_commits"] += 1
            masked = [s for s in masked if s not in {slots[i] for i in order}]
            if eos_pos is not None:
                masked = [s for s in masked if lp + s * L < eos_pos]
            notify("infill")
            if recompute_kv and len(order) > 1:
                # Slots infilled together now see each other: one causal forward over the commit order.
                new_ids = torch.tensor(row.ids[c:], device=device)
                new_pos = torch.tensor(row.pos[c:], device=device)
                del row.ids[c:], row.pos[c:], row.base[c:], row.start[c:]
                if cache is not None:
                    cache_keep(cache, c)
                    _run(model, meter, "recompute", row, cache, new_ids, new_pos, [new_ids.numel()])
                row.add(new_ids.tolist(), new_pos.tolist())  # causal now
                notify("recompute")
        if eos_pos is not None:
            break

    # Output: committed tokens sorted by position, cut after the first EOS.
    last = max(done) if eos_pos is None else eos_pos
    positions = [p for p in sorted(done) if p <= last]
    assert positions == list(range(lp, last + 1)), "committed positions must be contiguous up to the end"
    return torch.tensor([done[p] for p in positions], dtype=torch.long, device=device)
