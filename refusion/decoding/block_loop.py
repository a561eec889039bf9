"""The block loop shared by the block decoders: the block-diffusion ones (a KV cache of decided blocks) and the
semi-autoregressive masked-diffusion ones (a canvas each forward reads whole: mdm.py ``CanvasRule``). One loop,
and each decoder is its step rule (a ``BlockRule``) with its knobs.

The loop owns what every block decoder does the same way (docs/design.md §4b, §6):

  layout    each row of a left-padded batch on its own block grid (``BlockGrid``): positions count from the
            row's first real token; its first decoded block starts at ``starts[b]`` (on absolute positions,
            so it may hold the prompt's tail, or right after the prompt) and it has ``blocks[b]`` of them;
  prefill   the rule's (``BlockRule.start``), through ``prefill_blocks`` for the block-causal rules;
  a block   the rule decides it (``BlockRule.decide``), reading the cache through ``BlockRun.forward_block``,
            which drops whatever a previous forward of the block wrote (the cache keep) before each forward;
  store     the rule extends the cache with the decided block (``BlockRule.store``): before the finished rows
            leave, or, with ``store_late`` (an encoder that writes a block only when a next one reads it), after;
            a canvas rule (``kv`` false) keeps its canvas itself and stores nothing;
  stop      a row ends after the block in which an EOS appears among its response tokens (``stop_at_eos``), or
            after its last block; rows that ended leave the batch (their cache rows and visibility dropped) at
            once, or, with ``prune_rows`` false (a canvas rule), every row stays until none goes on;
  counting  one ``Meter`` per call (NFE per phase, KV peak, decode and forward time, the forward budget); the
            row blocks decoded; responses cut after the first EOS and to ``gen_length``.

So a rule holds no loop over blocks and no batch bookkeeping: only which positions a step decides, how many, and
in what order, plus how it calls its model when that is not ``common.forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .cache import cache_keep, cache_len
from .common import Meter, forward
from .tokens import cut_after_eos, is_eos, left_padding_mask


@dataclass(frozen=True)
class BlockGrid:
    """Where each row's blocks lie: block j of row b covers positions starts[b] + j * size + [0, size)."""
    size: int  # tokens per block
    lengths: list[int]  # real prompt tokens per row
    starts: list[int]  # position of each row's first decoded block
    blocks: list[int]  # blocks decoded per row

    @classmethod
    def lay(cls, lengths: list[int], size: int, gen_length: int, aligned: bool) -> BlockGrid:
        """aligned: blocks on absolute positions (block i = [i * size, (i + 1) * size)), so the first block decoded
        holds the prompt's last ``length % size`` tokens; else the first block starts right after the prompt.
        Either way a row decodes whole blocks up to prompt + gen_length rounded up to a block."""
        starts = [n // size * size if aligned else n for n in lengths]
        blocks = [-(-(n + gen_length - s) // size) for n, s in zip(lengths, starts)]
        return cls(size, lengths, starts, blocks)


class BlockRun:
    """The state of one decoder call that the loop shares with its rule: the rows still decoding (``live``,
    batch indices in batch order), the KV cache, the cache columns each live row reads (``seen`` [b, kv]), and
    the current block's positions (``pos`` [b, size]) and the cache length before it (``prefix``)."""

    def __init__(self, model, meter: Meter, grid: BlockGrid, eos: tuple[int, ...], device: torch.device):
        self.model, self.meter, self.grid, self.eos, self.device = model, meter, grid, eos, device
        self.live = list(range(len(grid.lengths)))
        self.cache: DynamicCache | None = None  # the rule's start sets it
        self.seen: torch.Tensor | None = None  # [b, kv] bool; the rule's start sets it
        self.out: list[list[torch.Tensor]] = [[] for _ in self.live]  # per row, its blocks' response tokens
        self.row_blocks = 0  # row blocks decoded (a stat)
        self.ended: set[int] = set()  # rows (batch indices) with an EOS in their response
        self.pos = torch.empty(0, dtype=torch.long, device=device)
        self.prefix = 0
        self._visible: torch.Tensor | None = None

    def begin(self, j: int, positions: bool = True) -> None:
        """Block j of every live row: its positions (unless ``positions`` is false: a canvas rule has its own,
        and every position of its blocks is a response's), the cache length it reads."""
        g = self.grid
        if positions:
            self.pos = torch.tensor([g.starts[b] + j * g.size for b in self.live], device=self.device)[:, None] \
                + torch.arange(g.size, device=self.device)
        self.prefix = cache_len(self.cache)
        self._visible = None
        self.row_blocks += len(self.live)

    def opening(self, j: int, input_ids: torch.Tensor, fill: int) -> torch.Tensor:
        """[b, size] the block before any step: ``fill`` (the mask id), after the prompt's tail in the first
        block of an aligned grid."""
        g, width = self.grid, input_ids.shape[1]
        block = torch.full((len(self.live), g.size), fill, dtype=torch.long, device=self.device)
        if j == 0:
            for i, b in enumerate(self.live):
                tail = input_ids[b, width - g.lengths[b] + g.starts[b]:]
                block[i, :tail.numel()] = tail
        return block

    @property
    def visible(self) -> torch.Tensor:
        """bool [b, size, kv + size]: a block sees the cache columns its row reads and the whole of itself
        (built once per block)."""
        if self._visible is None:
            n, size = len(self.live), self.grid.size
            self._visible = torch.cat([self.seen[:, None, :].expand(-1, size, -1),
                                       torch.ones(n, size, size, dtype=torch.bool, device=self.device)], dim=-1)
        return self._visible

    def forward_block(self, phase: str, block: torch.Tensor, logits: bool = True) -> torch.Tensor:
        """One counted forward of the block [b, size] after the cache, under ``visible``: logits [b, size, V]
        (``logits`` false: a call made for its KV only, whose float32 logits are not copied: [b, 0, V]). The
        cache is first cut back to the block's prefix, so it then holds the prefix and this forward's KV of the
        block (a denoise step's KV is dropped so by the next forward; a store's stays)."""
        cache_keep(self.cache, self.prefix)
        return forward(self.model, self.meter, phase, block, position_ids=self.pos, visible=self.visible,
                       cache=self.cache, keep=None if logits else slice(0, 0))

    def extend_seen(self, block: torch.Tensor, fill: int | None) -> None:
        """The cache now holds (or is about to hold) the block: each row reads it unless still ``fill`` somewhere
        (a block left masked is not stored, as SDAR's generate.py leaves it)."""
        if fill is None:
            stored = torch.ones(block.shape, dtype=torch.bool, device=self.device)
        else:
            stored = (~(block == fill).any(-1))[:, None].expand(-1, block.shape[1])
        self.seen = torch.cat([self.seen, stored], dim=-1)

    def collect(self, j: int, block: torch.Tensor, stop_at_eos: bool = True) -> list[int]:
        """Block j [b, size] decided: each row's response part joins its answer. Returns the indices into
        ``live`` of the rows that go on: blocks left and, with ``stop_at_eos``, no EOS among their response
        tokens yet (in this block or an earlier one: a row kept in the batch after its EOS stays ended)."""
        g = self.grid
        hit = is_eos(block, self.eos)
        if self.pos.numel():  # the prompt's tail in a block is no response
            hit &= self.pos >= torch.tensor([g.lengths[b] for b in self.live], device=self.device)[:, None]
        ended = hit.any(-1).tolist()
        keep = []
        for i, b in enumerate(self.live):
            first = max(0, g.lengths[b] - (g.starts[b] + j * g.size))  # the prompt's tail is no response
            self.out[b].append(block[i, first:])
            if ended[i] and stop_at_eos:
                self.ended.add(b)
            if j + 1 < g.blocks[b] and b not in self.ended:
                keep.append(i)
        return keep

    def prune(self, keep: list[int]) -> None:
        """Only the live rows ``keep`` (indices into ``live``) go on: the others leave the cache and the batch."""
        if len(keep) < len(self.live):
            idx = torch.tensor(keep, device=self.device)
            self.cache.batch_select_indices(idx)
            self.seen = self.seen[idx]
            self.pos = self.pos[idx]
            self.live = [self.live[i] for i in keep]


class BlockRule:
    """A block decoder's step rule: the loop (``decode_blocks``) calls ``start`` once, then per block ``decide``
    and ``store``. Subclasses set the class attributes and override the methods."""
    phases: tuple[str, ...] = ()  # the meter's phases
    aligned: bool = True  # BlockGrid.lay
    store_late: bool = False  # store after the ended rows left, and only when a next block reads it
    fill: int | None = None  # the id of an undecided position (the mask id), None: the rule fills the block itself
    compile: bool = False  # forwards through the compiled path (Meter(compile=...); the rule's caches: new_cache)
    kv: bool = True  # the loop keeps the decided blocks' KV (``store``, ``seen``); False: the rule keeps a canvas
    stop_at_eos: bool = True  # a row ends after the block in which an EOS appears in its response
    prune_rows: bool = True  # ended rows leave the batch at once (the cache rule's); False: all stay until none goes on
    size: int = 0  # tokens per block
    gen_length: int = 0

    def budget(self, grid: BlockGrid) -> tuple[int, int | None]:
        """(response length, steps) for ``Meter.track``: the commit log's width and the forward budget."""
        return self.gen_length, None

    def start(self, run: BlockRun, input_ids: torch.Tensor, pad: torch.Tensor) -> None:
        """Set ``run.cache`` and ``run.seen``, and prefill (``pad``: the [B, P] padding mask)."""
        raise NotImplementedError

    def decide(self, run: BlockRun, j: int, block: torch.Tensor | None) -> torch.Tensor:
        """Decode block j of the live rows from its opening [b, size] (None when ``fill`` is None): returns the
        decided block [b, size], its commits logged (``Meter.commit``)."""
        raise NotImplementedError

    def store(self, run: BlockRun, block: torch.Tensor) -> None:
        """Write the decided block's KV into the cache."""
        raise NotImplementedError

    def stats(self, run: BlockRun) -> dict:
        """Extra stats of the call."""
        return {}


def decode_blocks(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rule: BlockRule,
                  eos: tuple[int, ...]) -> tuple[list[torch.Tensor], dict]:
    """The block loop (module doc) of a left-padded batch, input_ids [B, P] and attention_mask [B, P] or None,
    every row as alone: (responses, stats)."""
    device = input_ids.device
    pad = left_padding_mask(input_ids, attention_mask)
    grid = BlockGrid.lay(pad.sum(-1).tolist(), rule.size, rule.gen_length, rule.aligned)
    meter = Meter(model, rule.phases, compile=rule.compile)
    length, steps = rule.budget(grid)
    meter.track(input_ids.shape[0], length, device, steps=steps)
    run = BlockRun(model, meter, grid, eos, device)
    rule.start(run, input_ids, pad)
    del pad  # [B, P]: not alive through the decode
    for j in range(max(grid.blocks)):
        run.begin(j, positions=rule.kv)
        opening = None if rule.fill is None else run.opening(j, input_ids, rule.fill)
        block = rule.decide(run, j, opening)
        if rule.kv and not rule.store_late:
            rule.store(run, block)
            run.extend_seen(block, rule.fill)
        keep = run.collect(j, block, rule.stop_at_eos)
        if not keep:
            break
        if rule.prune_rows:
            run.prune(keep)
        if rule.kv and rule.store_late:
            block = block[keep]
            run.extend_seen(block, rule.fill)
            rule.store(run, block)
    responses = [cut_after_eos(torch.cat(parts), eos)[:rule.gen_length] for parts in run.out]
    return responses, meter.finish(responses, **rule.stats(run))


def prefill_blocks(run: BlockRun, input_ids: torch.Tensor, widths: list[int], fill: int) -> torch.Tensor:
    """The block-causal prefill: one "prefill" forward of each row's first ``widths[b]`` positions (whole blocks:
    its prompt, then ``fill`` past the prompt's end), rows left-padded by whole blocks to a common width, a query
    seeing the keys of its own and earlier blocks; a pad sees only itself. Writes their KV into ``run.cache``.
    Returns real [B, width], the cache columns that hold a row's own tokens. No forward when every width is 0."""
    g, device, batch, cols = run.grid, run.device, input_ids.shape[0], input_ids.shape[1]
    wide = max(widths)
    ids = torch.full((batch, wide), fill, dtype=torch.long, device=device)
    pos = torch.zeros(batch, wide, dtype=torch.long, device=device)
    real = torch.zeros(batch, wide, dtype=torch.bool, device=device)
    for b, w in enumerate(widths):
        n = min(w, g.lengths[b])  # the prompt's part; the rest stays fill
        ids[b, wide - w:wide - w + n] = input_ids[b, cols - g.lengths[b]:cols - g.lengths[b] + n]
        pos[b, wide - w:], real[b, wide - w:] = torch.arange(w, device=device), True
    if wide:
        blk = pos // g.size
        visible = (blk[:, None, :] <= blk[:, :, None]) & real[:, None, :] & real[:, :, None]
        visible |= torch.eye(wide, dtype=torch.bool, device=device)[None] & ~real[:, :, None]  # pads: themselves
        # for its KV only: no float32 copy of its logits (common.forward's keep)
        forward(run.model, run.meter, "prefill", ids, position_ids=pos, visible=visible, cache=run.cache,
                keep=slice(0, 0))
    return real
