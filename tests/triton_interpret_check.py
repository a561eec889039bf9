"""The Triton slot-attention kernel against the reference on the test grid; prints JSON rows.

Run by tests/test_kernels.py in a subprocess: with TRITON_INTERPRET=1 in its environment (set
before triton is imported, which is why this is a separate process) on the CPU, or natively
on CUDA. Not collected by pytest (no test_ prefix).

    TRITON_INTERPRET=1 python tests/triton_interpret_check.py --device cpu --dtype float32 \
        --grid '{"layouts": [[7, [4, 4]]], "heads": [[8, 2]], "dims": [32]}' --save /tmp/pairs.pt

Each row names a key of the saved file, which maps it to (kernel output, reference) on the CPU: the
test compares them with the suite's dtype-aware tolerance (tests/conftest.py, TOLERANCES).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from refusion.kernels import slot_attention_op
from refusion.slot_attention import slot_attention

def qkv(prefix_len, slot_lens, heads, kv_heads, dim, batch=1, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = sum(slot_lens)
    q = torch.randn(batch, heads, n, dim, generator=g)
    k = torch.randn(batch, kv_heads, prefix_len + n, dim, generator=g)
    v = torch.randn(batch, kv_heads, prefix_len + n, dim, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]



def main() -> int:
    from refusion.triton_slot_attention import triton_slot_attention  # imports triton: after TRITON_INTERPRET is read

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--grid", required=True,
                   help='JSON {"layouts": [[prefix_len, [slot lens]], ...], "heads": [[h, kv_h], ...], "dims": [...]}'
                   " (tests/test_kernels.py owns the grid)")
    p.add_argument("--save", required=True, help="torch.save file for {key: (output, reference)}")
    a = p.parse_args()
    grid = json.loads(a.grid)
    LAYOUTS, HEADS, DIMS = grid["layouts"], grid["heads"], grid["dims"]
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    rows, pairs = [], {}

    def keep(row: dict, out: torch.Tensor, ref: torch.Tensor) -> None:
        row["key"] = str(len(rows))
        row["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()  # for a reader; the test decides
        pairs[row["key"]] = (out.detach().cpu(), ref.detach().cpu())
        rows.append(row)

    for prefix_len, slot_lens in LAYOUTS:
        for heads, kv_heads in HEADS:
            for dim in DIMS:
                q, k, v = qkv(prefix_len, slot_lens, heads, kv_heads, dim, batch=2 if dim == 32 else 1, device=a.device, dtype=dtype)
                out = slot_attention_op(q, k, v, prefix_len, slot_lens, backend="triton")
                ref = slot_attention(q.float(), k.float(), v.float(), prefix_len, slot_lens)
                keep({"prefix_len": prefix_len, "slot_lens": slot_lens, "heads": heads, "kv_heads": kv_heads,
                      "dim": dim}, out, ref)
                if prefix_len > 16 and dim == 32:  # the prefix split over 3 programs (split-KV), merged after
                    out = triton_slot_attention(q, k, v, prefix_len, slot_lens, num_splits=3)
                    keep({"prefix_len": prefix_len, "slot_lens": slot_lens, "heads": heads,
                          "kv_heads": kv_heads, "dim": dim, "splits": 3}, out, ref)
    triton_logits, sdpa_logits = model_check(a.device, dtype)
    keep({"model": "tiny refusion, refusion_triton with slot_layout vs sdpa with the dense mask"},
         triton_logits, sdpa_logits)
    torch.save(pairs, a.save)
    print(json.dumps(rows))
    return 0


def model_check(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed forward of the tiny checkpoint (3 slots after an 11-token cache) through refusion_triton,
    the query a strided view as the model hands it over; returns (its logits, the dense-mask sdpa's)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from refusion.decoding.common import additive_mask
    from refusion.kernels import SlotLayout, register
    from refusion.slot_attention import slot_visibility

    register()
    root = Path(__file__).resolve().parents[1]
    model = AutoModelForCausalLM.from_pretrained(str(root / "checkpoints" / "tiny" / "refusion"), dtype=dtype)
    model = model.to(device).eval()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 900, (1, 11), generator=g).to(device)
    slots = torch.randint(4, 900, (1, 12), generator=g).to(device)
    pos = torch.cat([torch.arange(20, 24), torch.arange(13, 17), torch.arange(30, 34)])[None].to(device)
    outs = []
    for impl, kw in (("sdpa", {"attention_mask": additive_mask(slot_visibility(11, [4, 4, 4], device), dtype)}),
                     ("refusion_triton", {"slot_layout": SlotLayout(11, (4, 4, 4))})):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(prompt, cache=cache, use_cache=True)
            outs.append(model(slots, position_ids=pos, cache=cache, use_cache=True, **kw).logits.float())
    return outs[1], outs[0]


if __name__ == "__main__":
    sys.exit(main())
