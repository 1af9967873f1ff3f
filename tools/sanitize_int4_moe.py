"""Small int4_moe run for compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool memcheck  python tools/sanitize_int4_moe.py
    compute-sanitizer --tool racecheck python tools/sanitize_int4_moe.py

Covers the K2 hidden size (H = 7168) with I = 256 on a few experts: the decode path (T·k <= 32:
cp.async rings; once with an expert map and int64 ids; once with T·k = 2, whose gate/up is split
along K and reduced through a thread-block cluster), the grouped GEMMs with block_size 32 and 64
(T·k > 32), an expert map, int64 ids, and the repack; then decode-path calls with a shared expert
(Is = 256, and Is = 200, which leaves idle shared blocks, unsplit and split) and a residual.  The
kernel chooses the K splits from shapes (csrc/moe_decode.cu, up_splits): none while a call has at
least half as many units (I / 16 · T · k) as the GPU has SMs, else about one block per SM, so
T·k <= 4 at I = 256 splits on an H100 or H200; each label gives the splits that rule picks here.
Exits non-zero if a result is off (relative error > 1e-2 against the reference).  With
``--decode-only`` it runs only the decode-path calls (racecheck is slow on the grouped GEMMs).
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kdtree.ops import int4_moe_reference, int4_moe_weights  # noqa: E402
from torch_kdtree.ops.moe import int4_moe_workspace_bytes  # noqa: E402


def compressed(E, N, K, gen):
    packed = torch.randint(-2**31, 2**31, (E, N, K // 8), generator=gen, dtype=torch.int32, device="cuda")
    scale = ((torch.rand((E, N, K // 32), generator=gen, device="cuda") + 0.5) / (4.6 * math.sqrt(K)))
    return packed, scale.to(torch.bfloat16)


def up_splits(T: int, k: int, H: int, I: int) -> int:
    """csrc/moe_decode.cu's up_splits on this GPU (for the labels): gate/up's K splits of a decode call."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    units = I // 16 * T * k
    want = 1 if 2 * units >= sms else -(-sms // units)
    return max(1, min(8, want, H // 64 // 8))


def close(out, ref, label: str) -> bool:
    """Prints the relative error of out against ref; whether it is <= 1e-2 and out has no NaN."""
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    print(f"{label}: rel err {err:.2e}")
    return err <= 1e-2 and not torch.isnan(out).any().item()


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, H, I = 12, 7168, 256
    w = int4_moe_weights(*compressed(E, I, H, gen), *compressed(E, I, H, gen), *compressed(E, H, I, gen))
    emap = torch.full((20,), -1, dtype=torch.int32, device="cuda")
    emap[torch.randperm(20, generator=gen, device="cuda")[:E]] = torch.arange(E, dtype=torch.int32, device="cuda")
    ok = True
    cases = [(3, 8, 8, 7, False, False), (1, 8, 8, 7, True, True), (1, 2, 8, 1, False, False),
             (37, 8, 32, 1, True, True), (70, 4, 64, 2, False, False)]
    if "--decode-only" in sys.argv:
        cases = [c for c in cases if c[0] * c[1] <= 32]
    for T, k, block_size, k_splits, use_map, long_ids in cases:
        num_global = 20 if use_map else E
        x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
        ids = torch.rand((T, num_global), generator=gen, device="cuda").argsort(1)[:, :k].contiguous()
        ids = ids if long_ids else ids.to(torch.int32)
        tw = torch.rand((T, k), generator=gen, device="cuda")
        m = emap if use_map else None
        ws = torch.empty(int4_moe_workspace_bytes(T, k, E, H, I, block_size, k_splits), dtype=torch.uint8,
                         device="cuda")
        out = torch.full_like(x, float("nan"))
        torch.ops.kdtree.int4_moe_out(x, *w[:4], ids, tw, m, 32, block_size, k_splits, ws, out)
        ref = int4_moe_reference(x, *w[:4], ids, tw, m, 32)
        path = f"decode, gate/up K splits: {up_splits(T, k, H, I)}" if T * k <= 32 else "grouped"
        ok &= close(out, ref, f"T={T} k={k} block_size={block_size} k_splits={k_splits} expert_map={use_map} ({path})")
    for T, k, Is in [(1, 8, 256), (3, 4, 200), (1, 3, 200)]:
        x = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
        ids = torch.rand((T, E), generator=gen, device="cuda").argsort(1)[:, :k].to(torch.int32).contiguous()
        tw = torch.rand((T, k), generator=gen, device="cuda")
        shared = [(torch.randn(shape, generator=gen, device="cuda") / math.sqrt(shape[1])).to(torch.bfloat16)
                  for shape in ((Is, H), (Is, H), (H, Is))]
        res = torch.randn((T, H), generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.ops.kdtree.int4_moe(x, *w[:4], ids, tw, None, 32, 8, 1, *shared, res)
        ref = int4_moe_reference(x, *w[:4], ids, tw, None, 32, 8, 1, *shared, res)
        ok &= close(out, ref, f"T={T} k={k} shared Is={Is} + residual (gate/up K splits: {up_splits(T, k, H, I)})")
    torch.cuda.synchronize()
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
