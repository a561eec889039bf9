"""Packed slot attention as a hand-written Triton kernel (forward only, for inference).

The pattern is `refusion/slot_attention.py`'s (docs/design.md §3 step 3): n packed query
tokens of k slots follow a prefix of C cached keys; query i sees every prefix key, the keys
of its own slot up to itself, and nothing of any other slot. The kernel is written in the
style of Triton's fused-attention tutorial, beside its reference (`slot_attention`):

  * one program per (block of BLOCK_M consecutive packed queries, batch row, query head);
  * it streams the shared prefix KV once per query block in BLOCK_N tiles with an online
    (running max / running sum) softmax, no mask but the tail bound;
  * then the slot part: only the packed keys from the slot start of the block's first query
    up to its last query, masked to "same slot and not after the query". Keys of slots that
    end before the block starts are never loaded, so the kernel is block-sparse by
    construction: it never visits the slot x other-slot blocks a dense mask would cover;
  * GQA: query head h reads KV head h // (H / Hkv); nothing is repeated in memory.

Shapes: query [B, H, n, D]; key / value [B, Hkv, C + n, D] (prefix first, then the packed
slots in query order; any strides); H a multiple of Hkv; D any size (padded to a power of
two >= 16 inside the kernel). Output [B, H, n, D] in the query's dtype. Dtypes: float32
(dot products in IEEE float32, no TF32), bfloat16 and float16 (dot products on tensor cores,
softmax and accumulation in float32).

Tested: tests/test_kernels.py under TRITON_INTERPRET=1 on the CPU (float32; max abs
difference <= 1e-5 against `slot_attention` for several slot counts and lengths, prefix 0
and > 0, GQA ratios 1 and 4, head_dim 32 and 128), run in a subprocess so the interpreter
setting reaches no other test. On CUDA: the same test, marked `gpu` (float32 and
bfloat16), run by scripts/gpu_check.sh; this module has not run on a GPU in this
repository yet (no GPU was available when it was written), see results/bench_kernels.json.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

try:  # triton is optional (the test extra pins it); the kernel needs it, nothing else here does
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is not installed
    triton = None
    tl = None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def missing(device: torch.device | str | None = None) -> str | None:
    """None when the kernel can run on `device` (None: on this machine), else one line saying what is missing."""
    if triton is None:
        return "attn='triton' needs the triton package (pip install triton==3.9.0), which is not installed"
    if interpreting():
        return None
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return (f"attn='triton' needs CUDA tensors, got {dev.type} ones (TRITON_INTERPRET=1 runs the kernel in "
                "Triton's CPU interpreter, for tests only)")
    if not torch.cuda.is_available():
        return (f"attn='triton' needs a CUDA device, and this torch ({torch.__version__}) sees none "
                "(TRITON_INTERPRET=1 runs the kernel in Triton's CPU interpreter, for tests only)")
    return None


if triton is not None:

    @triton.jit
    def _attend_keys(q, k, v, visible, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
        """One block of keys in the online softmax (FlashAttention's update): q [BLOCK_M, BLOCK_D], k
        [BLOCK_D, BLOCK_N], v [BLOCK_N, BLOCK_D], ``visible`` a mask broadcast to [BLOCK_M, BLOCK_N]; the running
        max m_i and sum l_i [BLOCK_M] and the unnormalised output acc [BLOCK_M, BLOCK_D], float32, updated.
        Scores in base 2 (``qk_scale`` includes log2 e)."""
        if IEEE:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _slot_attn_fwd(
        Q, K, V, O, SID, SSTART, M_PART, L_PART,
        sm_scale, prefix_len, n_q, H, GROUP, split_len, num_splits,
        s_qb, s_qh, s_qm, s_qd,
        s_kb, s_kh, s_kn, s_kd,
        s_vb, s_vh, s_vn, s_vd,
        s_os, s_ob, s_oh, s_om, s_od,
        HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, SPLIT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        pid_s = tl.program_id(2)  # prefix split (split-KV; 0 when the prefix is not split)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUP  # GQA: the KV head this query head reads

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < n_q
        d_ok = offs_d < HEAD_D

        q_ptrs = Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        sid_q = tl.load(SID + offs_m, mask=m_ok, other=-1)
        k_base = K + b * s_kb + hk * s_kh
        v_base = V + b * s_vb + hk * s_vh

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))

        # 1. The shared prefix: every key visible to every query, read once for the whole query block
        #    (with SPLIT, this program's share [p0, p1) of it; the shares are merged afterwards).
        p0 = pid_s * split_len
        p1 = tl.minimum(p0 + split_len, prefix_len)
        for start_n in range(p0, p1, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < p1
            k = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            m_i, l_i, acc = _attend_keys(q, k, v, n_ok[None, :], m_i, l_i, acc, qk_scale, IEEE)

        # 2. The slots: packed keys [slot start of the block's first query, the block's last query]
        #    (by the last split only).
        row0 = pid_m * BLOCK_M
        lo = tl.load(SSTART + row0)
        hi = tl.minimum(row0 + BLOCK_M, n_q)
        hi = tl.where(pid_s == num_splits - 1, hi, lo)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            sid_k = tl.load(SID + offs_n, mask=n_ok, other=-2)
            kv_n = prefix_len + offs_n
            k = tl.load(k_base + kv_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(v_base + kv_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            seen = (sid_k[None, :] == sid_q[:, None]) & (offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :]
            m_i, l_i, acc = _attend_keys(q, k, v, seen, m_i, l_i, acc, qk_scale, IEEE)

        if SPLIT:  # unnormalised partial results: O is [S, B, H, n, D] float32, M/L_PART [S, B, H, n]
            o_ptrs = O + pid_s * s_os + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
            tl.store(o_ptrs, acc, mask=m_ok[:, None] & d_ok[None, :])
            ml = (pid_s * (tl.num_programs(1)) + pid_bh) * n_q + offs_m
            tl.store(M_PART + ml, m_i, mask=m_ok)
            tl.store(L_PART + ml, l_i, mask=m_ok)
        else:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows past n_q only; a real query always sees itself
            out = acc / l_safe[:, None]
            o_ptrs = O + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


_TABLES: dict = {}  # (slot_lens, device) -> (slot index, slot start), int32 [n] each; kept small


def _tables(slot_lens: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [n] slot index and [n] slot start (packed index of the slot's first token) of every query."""
    key = (tuple(slot_lens), str(device))
    hit = _TABLES.get(key)
    if hit is None:
        lens = torch.as_tensor(list(slot_lens), dtype=torch.long)
        sid = torch.repeat_interleave(torch.arange(len(lens)), lens)
        starts = torch.cumsum(lens, 0) - lens
        hit = (sid.to(device=device, dtype=torch.int32), starts[sid].to(device=device, dtype=torch.int32))
        if len(_TABLES) >= 64:
            _TABLES.clear()
        _TABLES[key] = hit
    return hit


def _plan(n: int, prefix_len: int, programs_per_row: int, head_dim: int, device: torch.device,
          num_splits: int | None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, prefix splits) for a packed run of n queries.

    On a GPU: query blocks of 64 rows, smaller while the grid would not fill the SMs twice; a long
    prefix is split across programs (split-KV, merged by log-sum-exp) while the grid still would not.
    """
    if interpreting():  # the interpreter runs numpy per program: small tiles keep tests quick
        return 16, 16, 1, 1, num_splits or 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block_m = 64
    while block_m > 16 and triton.cdiv(n, block_m) * programs_per_row < 2 * sms:
        block_m //= 2
    block_n = 64 if head_dim <= 128 else 32
    grid = triton.cdiv(n, block_m) * programs_per_row
    if num_splits is None:
        num_splits = max(1, min(triton.cdiv(2 * sms, grid), prefix_len // 512))
    return block_m, block_n, 4, 2, num_splits


def triton_slot_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_len: int,
    slot_lens: Sequence[int],
    scale: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Packed slot attention with the Triton kernel; same contract as `slot_attention.slot_attention`.

    `num_splits`: split the prefix across this many programs per query block (None: chosen from the
    grid and prefix sizes; 1 on the interpreter). Inputs are checked by the caller
    (`refusion.kernels.slot_attention_op`); this function only refuses a machine or device the
    kernel cannot run on (ValueError, one line).
    """
    why = missing(query.device)
    if why is not None:
        raise ValueError(why)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive integer or None, got {num_splits!r}")
    bsz, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    scale = dim**-0.5 if scale is None else float(scale)
    sid, sstart = _tables(slot_lens, query.device)
    block_m, block_n, warps, stages, splits = _plan(n, prefix_len, bsz * heads, dim, query.device, num_splits)
    # Each split a whole number of key tiles; splits left with no prefix keys are dropped.
    split_len = triton.cdiv(triton.cdiv(max(prefix_len, 1), splits), block_n) * block_n
    splits = max(1, triton.cdiv(prefix_len, split_len))
    block_d = max(16, triton.next_power_of_2(dim))
    grid = (triton.cdiv(n, block_m), bsz * heads, splits)
    if splits == 1:
        out = torch.empty_like(query)
        m_part = l_part = out  # unused
        o_strides = (0, *out.stride())
    else:
        out = torch.empty(splits, bsz, heads, n, dim, device=query.device, dtype=torch.float32)
        m_part = torch.empty(splits, bsz * heads, n, device=query.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        o_strides = out.stride()
    _slot_attn_fwd[grid](
        query, key, value, out, sid, sstart, m_part, l_part,
        scale, int(prefix_len), n, heads, heads // kv_heads, split_len, splits,
        *query.stride(), *key.stride(), *value.stride(), *o_strides,
        HEAD_D=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=query.dtype == torch.float32, SPLIT=splits > 1, num_warps=warps, num_stages=stages,
    )
    if splits == 1:
        return out
    # Merge the splits (running maxima are in log2 units): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
    m_part = m_part.view(splits, bsz, heads, n)
    l_part = l_part.view(splits, bsz, heads, n)
    top = m_part.amax(0)
    w = torch.exp2(m_part - top)  # a split that saw no key has m = -inf: weight 0
    den = (w * l_part).sum(0)
    return ((out * w[..., None]).sum(0) / den[..., None]).to(query.dtype)
