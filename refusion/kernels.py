"""Fused slot-attention kernels behind one attention backend (docs/design.md §3 step 3, §8).

The model's attention receives the slot structure instead of a dense mask: a `SlotLayout`
(prefix length, slot lengths) says that the query run is k packed slots after a prefix
of cached keys, each query seeing the whole prefix, its own slot up to itself and no other
slot. Three kernels compute that pattern (the reference is `refusion/slot_attention.py`):

  * "sdpa"  -- the dense boolean mask [q, prefix + q] built from the layout, then PyTorch's
               scaled_dot_product_attention (what the decoders did before, kept as a baseline);
  * "flex"  -- `torch.nn.attention.flex_attention` with a `mask_mod` for slot visibility and
               a BlockMask built from the layout (full blocks over the prefix, partial blocks
               on the slots' diagonal band, nothing across slots), compiled with
               torch.compile once per query-length bucket (`flex_slot_attention`);
  * "triton" -- a hand-written Triton kernel, `refusion/triton_slot_attention.py`.
At the op level (`slot_attention_op`, used by the tests and `make bench-kernels`) two more
names are accepted: "reference" (the two-part log-sum-exp reference) and "replicated" (the
prefix KV copied once per slot into batch rows, one causal SDPA call: the authors' layout).

The model side: `register()` adds the attention implementations "refusion_sdpa",
"refusion_flex" and "refusion_triton" to transformers' `AttentionInterface` (and a matching
mask function to `AttentionMaskInterface`), so `from_pretrained(..., attn_implementation=
"refusion_flex")` or `model.set_attn_implementation("refusion_flex")` selects one. A forward
then passes the layout as a keyword, `model(ids, position_ids=..., cache=..., slot_layout=
SlotLayout(prefix_len, slot_lens))`, with no attention mask. Without `slot_layout` these
implementations behave like "sdpa": a given mask (a 2-D padding mask or a 4-D one) is applied
densely, and no mask at all means causal after the cache. The `refusion` decoder's knob
`attn="sdpa" | "flex" | "triton"` does this for the plan, global-verify and parallel-infill
forwards (`attention_backend` switches the model for the length of one decoder call).

Bad input raises ValueError naming the argument before any kernel runs: slot lengths that do
not sum to the query length (`slot_lens`), a prefix longer (or shorter) than the cache
(`prefix_len`), an unknown backend (`backend` / `attn`); without triton or CUDA, "triton" is
refused with one line saying which is missing.

Flex compiles lazily: the first call for a query-length bucket compiles (about 20 s on a
2-core CPU with inductor's C++ backend, seconds on a GPU) and says so on stderr.
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .slot_attention import replicated_slot_attention, slot_attention, slot_visibility

BACKENDS = ("sdpa", "flex", "triton")  # the model backends (decoder knob `attn`)
OP_BACKENDS = ("sdpa", "replicated", "reference", "flex", "triton")  # op level: tests and the benchmark
IMPLEMENTATIONS = {b: f"refusion_{b}" for b in BACKENDS}  # attn_implementation names registered with transformers

# ---------------------------------------------------------------- the layout and input checks


@dataclass(frozen=True)
class SlotLayout:
    """A query run of packed slots after a shared prefix: `prefix_len` keys every query sees, then
    the keys of the queries themselves, `slot_lens[i]` consecutive tokens per slot, in query order.

    One slot of length q is the ordinary causal pattern after a cache of `prefix_len` keys.
    """

    prefix_len: int
    slot_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        p = self.prefix_len
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise ValueError(f"prefix_len must be an integer >= 0, got {p!r}")
        try:
            lens = tuple(self.slot_lens)
        except TypeError:
            raise ValueError(f"slot_lens must be a sequence of positive integers, got {self.slot_lens!r}") from None
        if not lens or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lens):
            raise ValueError(f"slot_lens must be a non-empty sequence of positive integers, got {self.slot_lens!r}")
        object.__setattr__(self, "slot_lens", lens)

    @property
    def q_len(self) -> int:
        return sum(self.slot_lens)

    def check(self, q_len: int, kv_len: int) -> None:
        """ValueError naming the argument unless queries and keys have this layout's lengths."""
        if self.q_len != q_len:
            raise ValueError(f"slot_lens must sum to the query length {q_len}, got {list(self.slot_lens)} "
                             f"(sum {self.q_len})")
        cached = kv_len - q_len
        if self.prefix_len > cached:
            raise ValueError(f"prefix_len {self.prefix_len} is longer than the cache: the keys hold {cached} cached "
                             f"tokens before the {q_len} query tokens")
        if self.prefix_len < cached:
            raise ValueError(f"prefix_len {self.prefix_len} must cover the whole cache ({cached} cached keys before "
                             f"the {q_len} query tokens)")


def check_backend(backend: object, choices: Sequence[str] = BACKENDS, name: str = "backend") -> str:
    if backend not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {backend!r}")
    return str(backend)


def _check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query, key and value must be 4-D [B, heads, T, D], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        raise ValueError(f"key must match query in batch and head_dim, got {tuple(key.shape)} for query "
                         f"{tuple(query.shape)}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of key heads ({key.shape[1]})")


def missing(backend: str, device: torch.device | str | None = None) -> str | None:
    """None when `backend` can run on `device` (None: anywhere on this machine), else one line saying why not."""
    if backend == "triton":
        from .triton_slot_attention import missing as triton_missing

        return triton_missing(device)
    return None


def require(backend: str, device: torch.device | str | None = None) -> None:
    why = missing(backend, device)
    if why is not None:
        raise ValueError(why)


# ---------------------------------------------------------------- the kernels


def sdpa_slot_attention(query, key, value, prefix_len, slot_lens, scale=None) -> torch.Tensor:
    """Dense-mask baseline: the bool [n, prefix_len + n] visibility through SDPA (GQA without copies)."""
    mask = _dense_mask(prefix_len, tuple(slot_lens), query.device)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])


_DENSE: OrderedDict = OrderedDict()  # (prefix_len, slot_lens, device) -> bool mask; the layers of one forward share it


def _dense_mask(prefix_len: int, slot_lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    key = (prefix_len, slot_lens, str(device))
    mask = _DENSE.get(key)
    if mask is None:
        mask = _DENSE[key] = slot_visibility(prefix_len, slot_lens, device)
        while len(_DENSE) > 4:
            _DENSE.popitem(last=False)
    return mask


def replicated_kv_attention(query, key, value, prefix_len, slot_lens, scale=None) -> torch.Tensor:
    """The authors' layout: the prefix KV copied once per slot into batch rows, one causal SDPA call.

    Equal slot lengths only (the decoders' case); otherwise the per-slot loop of
    `slot_attention.replicated_slot_attention`. Builds k copies of the prefix K and V (KV heads).
    """
    lens = tuple(slot_lens)
    if len(set(lens)) != 1:
        return replicated_slot_attention(query, key, value, prefix_len, lens, scale)
    bsz, heads, n, dim = query.shape
    kvh, k, length = key.shape[1], len(lens), lens[0]

    def rows(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, P + n, D] -> [B * k, Hkv, P + L, D]
        own = x[:, :, prefix_len:].reshape(bsz, kvh, k, length, dim).transpose(1, 2)
        shared = x[:, None, :, :prefix_len].expand(bsz, k, kvh, prefix_len, dim)
        return torch.cat([shared, own], dim=3).reshape(bsz * k, kvh, prefix_len + length, dim)

    q = query.reshape(bsz, heads, k, length, dim).transpose(1, 2).reshape(bsz * k, heads, length, dim)
    causal = torch.ones(length, prefix_len + length, dtype=torch.bool, device=query.device).tril(prefix_len)
    out = torch.nn.functional.scaled_dot_product_attention(q, rows(key), rows(value), attn_mask=causal, scale=scale,
                                                           enable_gqa=heads != kvh)
    return out.reshape(bsz, k, heads, length, dim).transpose(1, 2).reshape(bsz, heads, n, dim)


# ---- flex

FLEX_BLOCK = 128  # BlockMask tile (flex_attention's default sparse block size)
PREFIX_SLOT, PAD_QUERY, PAD_KEY = -1, -2, -3  # slot ids of prefix keys, padding queries, padding keys


def flex_bucket(q_len: int) -> int:
    """The padded query length: 16, 32, 64, 128, then multiples of 128 (one compile per bucket)."""
    if q_len <= FLEX_BLOCK:
        return max(16, 1 << (q_len - 1).bit_length())
    return -(-q_len // FLEX_BLOCK) * FLEX_BLOCK


@dataclass(frozen=True)
class _FlexPlan:
    """Everything flex needs for one (layout, key length): the BlockMask tables and the mask_mod's tensors."""

    kv_num_blocks: torch.Tensor  # int32 [1, 1, q blocks]: partial blocks per query tile
    kv_indices: torch.Tensor  # int32 [1, 1, q blocks, kv blocks]
    full_kv_num_blocks: torch.Tensor  # blocks every query of the tile sees whole (the prefix)
    full_kv_indices: torch.Tensor
    q_slot: torch.Tensor  # int32 [q tiles * FLEX_BLOCK]: slot of each (padded) query
    k_slot: torch.Tensor  # int32 [kv tiles * FLEX_BLOCK]: slot of each key (PREFIX_SLOT for the prefix)
    k_pos: torch.Tensor  # int32 [kv tiles * FLEX_BLOCK]: packed query index of each slot key


def flex_block_tables(layout: SlotLayout, q_pad: int, kv_len: int, block: int = FLEX_BLOCK) -> list[tuple[list, list]]:
    """Per query tile of `block` rows: (full kv blocks, partial kv blocks), from the layout alone.

    Full: the kv blocks wholly inside the prefix (every query sees them, padding queries too).
    Partial: the block holding the prefix's tail (if the prefix does not end on a block edge)
    and the blocks from the slot start of the tile's first query to its last query. Blocks of
    slots that end before the tile starts are left out: they are never visited.
    """
    p, n = layout.prefix_len, layout.q_len
    starts, s = [], 0
    for length in layout.slot_lens:
        starts += [s] * length
        s += length
    full = list(range(p // block))
    tiles = []
    for i in range(-(-q_pad // block)):
        r0, r1 = i * block, min((i + 1) * block, n)  # real query rows of the tile
        part = {p // block} if p % block else set()
        if r0 < n:
            part.update(range((p + starts[r0]) // block, (p + r1 - 1) // block + 1))
        tiles.append((full, sorted(b for b in part if b * block < kv_len)))
    return tiles


_PLANS: OrderedDict = OrderedDict()  # the cached BlockMask data: (layout, q_pad, kv_len, device) -> _FlexPlan


def _flex_plan(layout: SlotLayout, q_pad: int, kv_len: int, device: torch.device) -> _FlexPlan:
    key = (layout, q_pad, kv_len, str(device))
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan
    tiles = flex_block_tables(layout, q_pad, kv_len)
    nkb = -(-kv_len // FLEX_BLOCK)
    width = max(nkb, 2)  # index tables at least 2 wide: a width of 1 would be specialised and recompile later

    def table(which: int) -> tuple[torch.Tensor, torch.Tensor]:
        num = torch.zeros(1, 1, len(tiles), dtype=torch.int32)
        idx = torch.zeros(1, 1, len(tiles), width, dtype=torch.int32)
        for i, t in enumerate(tiles):
            num[0, 0, i] = len(t[which])
            idx[0, 0, i, :len(t[which])] = torch.tensor(t[which], dtype=torch.int32)
        return num.to(device), idx.to(device)

    p, n = layout.prefix_len, layout.q_len
    sid = torch.repeat_interleave(torch.arange(len(layout.slot_lens), dtype=torch.int32),
                                  torch.tensor(layout.slot_lens))
    q_slot = torch.full((len(tiles) * FLEX_BLOCK,), PAD_QUERY, dtype=torch.int32)
    q_slot[:n] = sid
    k_slot = torch.full((nkb * FLEX_BLOCK,), PAD_KEY, dtype=torch.int32)
    k_slot[:p] = PREFIX_SLOT
    k_slot[p:p + n] = sid
    k_pos = torch.zeros(nkb * FLEX_BLOCK, dtype=torch.int32)
    k_pos[p:p + n] = torch.arange(n, dtype=torch.int32)
    (pn, pi), (fn, fi) = table(1), table(0)
    plan = _FlexPlan(pn, pi, fn, fi, q_slot.to(device), k_slot.to(device), k_pos.to(device))
    _PLANS[key] = plan
    while len(_PLANS) > 16:
        _PLANS.popitem(last=False)
    return plan


def _flex_core(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_slot, k_slot, k_pos,
               scale: float):
    """flex_attention over [B, H, q_pad, D] queries; every structure tensor is an input, so one compiled graph
    serves every layout of its shape bucket (no closure over Python values, nothing to re-guard)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def slot_visible(b, h, q_idx, kv_idx):
        ks = k_slot[kv_idx]
        return (ks == PREFIX_SLOT) | ((ks == q_slot[q_idx]) & (k_pos[kv_idx] <= q_idx))

    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=slot_visible,
                                    seq_lengths=(q.shape[2], k.shape[2]), compute_q_blocks=False)
    return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def flex_compiles_on_cpu() -> bool:
    """Whether inductor can build flex attention for the CPU in this process.

    Its CPU template needs AVX2 or AVX-512 (transpose and VNNI packing helpers exist only there), so it does
    not build on a CPU without AVX2, nor when ATEN_CPU_CAPABILITY=default turns the vector kernels off
    (torch 2.13 then fails in the C++ compiler rather than saying so). Mirrors torch's own check."""
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT" and os.environ.get("ATEN_CPU_CAPABILITY") != "default"


_COMPILED = None
FLEX_VARIANTS = 64  # compiled variants of _flex_core allowed in one process (buckets x head shapes x dtypes)
_SEEN: set = set()  # compile units announced so far


def _compiled():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_flex_core, fullgraph=True, dynamic=False)
    return _COMPILED


def flex_slot_attention(query, key, value, prefix_len, slot_lens, scale=None, *, compiled: bool = True
                        ) -> torch.Tensor:
    """Packed slot attention with flex_attention; same contract as `slot_attention.slot_attention`.

    Shapes: query [B, H, n, D]; key / value [B, Hkv, prefix_len + n, D]; output [B, H, n, D].
    Dtypes: float32, bfloat16, float16 (CPU: float32 and bfloat16). The query run is padded to
    `flex_bucket(n)` rows (padding rows see the prefix only and are dropped); the key length
    and the batch are dynamic dimensions, so one compile serves a bucket however long the cache
    grows. `compiled=False` runs flex's eager (unfused, reference) path: same mask, no compile.
    Tested: tests/test_kernels.py on the CPU in float32 (<= 1e-5 against the reference; the
    compiled kernel on a few shapes and through the tiny model, the eager path on the grid).
    """
    layout = SlotLayout(prefix_len, tuple(slot_lens))
    bsz, heads, n, dim = query.shape
    kv_len = key.shape[2]
    scale = dim**-0.5 if scale is None else float(scale)
    q_pad = flex_bucket(n)
    plan = _flex_plan(layout, q_pad, kv_len, query.device)
    q = torch.nn.functional.pad(query, (0, 0, 0, q_pad - n)) if q_pad != n else query.contiguous()
    k, v = key.contiguous(), value.contiguous()
    args = (q, k, v, plan.kv_num_blocks, plan.kv_indices, plan.full_kv_num_blocks, plan.full_kv_indices,
            plan.q_slot, plan.k_slot, plan.k_pos, scale)
    if not compiled:
        return _flex_core(*args)[:, :, :n]
    if query.device.type == "cpu" and not flex_compiles_on_cpu():
        raise RuntimeError(
            "compiled flex attention needs AVX2 or AVX-512 on the CPU, and this process runs ATen's "
            f"{torch.backends.cpu.get_cpu_capability()} kernels (ATEN_CPU_CAPABILITY="
            f"{os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}); use the sdpa attention backend "
            "(refusion_sdpa) or flex_slot_attention(..., compiled=False)")
    unit = (query.device.type, query.dtype, q_pad, heads, key.shape[1], dim, scale)
    fresh = unit not in _SEEN
    if fresh:
        _SEEN.add(unit)
        print(f"flex: compiling slot attention for query bucket {q_pad} ({query.device.type}, "
              f"{str(query.dtype).removeprefix('torch.')}, {heads}/{key.shape[1]} heads, head_dim {dim}); "
              "lazily, once per bucket, ~20 s on a CPU", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
    # Key length (and the tables that grow with it) and batch are dynamic: a growing cache or the
    # replicated layout's changing row count does not recompile.
    for t, dims in ((q, (0,)), (k, (0, 2)), (v, (0, 2)), (plan.kv_indices, (3,)), (plan.full_kv_indices, (3,)),
                    (plan.k_slot, (0,)), (plan.k_pos, (0,))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    # Every bucket, head shape and dtype is one more compiled variant of _flex_core; dynamo's default limit
    # of 8 per function would send later ones to the eager path, so the limit is raised for these calls only.
    # Forward only: no_grad also keeps the grad mode (a guard) the same for every caller.
    with torch._dynamo.config.patch(recompile_limit=FLEX_VARIANTS), torch.no_grad():
        out = _compiled()(*args)
    if fresh:
        print(f"flex: compiled query bucket {q_pad} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out[:, :, :n]


# ---------------------------------------------------------------- the op and the model backend


def slot_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_len: int,
    slot_lens: Sequence[int],
    *,
    backend: str = "flex",
    scale: float | None = None,
) -> torch.Tensor:
    """Packed slot attention by `backend` (one of OP_BACKENDS): query [B, H, n, D], key / value
    [B, Hkv, prefix_len + n, D] -> [B, H, n, D]. Inputs are checked before any kernel runs."""
    backend = check_backend(backend, OP_BACKENDS)
    _check_tensors(query, key, value)
    layout = SlotLayout(prefix_len, tuple(slot_lens) if not isinstance(slot_lens, int) else slot_lens)
    layout.check(query.shape[2], key.shape[2])
    require(backend, query.device)
    return _run(backend, query, key, value, layout, scale)


def _run(backend: str, query, key, value, layout: SlotLayout, scale: float | None) -> torch.Tensor:
    p, lens = layout.prefix_len, layout.slot_lens
    if backend == "flex":
        return flex_slot_attention(query, key, value, p, lens, scale)
    if backend == "triton":
        from .triton_slot_attention import triton_slot_attention

        return triton_slot_attention(query, key, value, p, lens, scale)
    if backend == "sdpa":
        return sdpa_slot_attention(query, key, value, p, lens, scale)
    if backend == "reference":
        return slot_attention(query, key, value, p, lens, scale)
    return replicated_kv_attention(query, key, value, p, lens, scale)


def _attention_function(backend: str):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  slot_layout: SlotLayout | None = None, **kwargs):
        """transformers attention function: query [B, H, q, D], key / value [B, Hkv, T, D] -> ([B, q, H, D], None)."""
        if slot_layout is None:
            if attention_mask is not None:  # a dense mask was given: apply it as SDPA does
                from transformers.integrations.sdpa_attention import sdpa_attention_forward

                return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
            slot_layout = SlotLayout(key.shape[2] - query.shape[2], (query.shape[2],))  # causal after the cache
        elif attention_mask is not None:
            raise ValueError("slot_layout replaces the attention mask: pass attention_mask=None with it")
        if dropout:
            raise ValueError(f"{IMPLEMENTATIONS[backend]} is inference-only (dropout must be 0, got {dropout})")
        slot_layout.check(query.shape[2], key.shape[2])
        out = _run(backend, query, key, value, slot_layout, scaling)
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = f"{IMPLEMENTATIONS[backend]}_attention"
    return attention


def _mask_function(*, attention_mask=None, **kwargs):
    """Mask interface of the refusion_* implementations: no mask unless a 2-D padding mask has zeros
    (then the dense SDPA mask, applied by the attention function's dense path)."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


_REGISTERED = False


def register() -> None:
    """Register refusion_sdpa / refusion_flex / refusion_triton with transformers (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for backend, name in IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _attention_function(backend))
        AttentionMaskInterface.register(name, _mask_function)
    _REGISTERED = True


@contextmanager
def attention_backend(model, attn: str) -> Iterator[None]:
    """For the body, the model's attention is the refusion_<attn> implementation (restored after);
    "sdpa" leaves the model as it is (the decoders' dense-mask path)."""
    attn = check_backend(attn, BACKENDS, "attn")
    if attn == "sdpa":
        yield
        return
    register()
    before = model.config._attn_implementation
    name = IMPLEMENTATIONS[attn]
    if before == name:
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


__all__ = [
    "BACKENDS", "IMPLEMENTATIONS", "OP_BACKENDS", "SlotLayout", "attention_backend", "flex_bucket",
    "flex_slot_attention", "missing", "register", "require", "sdpa_slot_attention", "slot_attention_op",
]
