"""Representative kdtree::gemv and kdtree::moe_gemv calls for compute-sanitizer memcheck: gemv with
each prologue, several weights, K past one block of rows in shared memory and M past one block of
rows, and the router form (fp32 first output, the prologue's output returned); moe_gemv with and
without the shared expert, odd sizes and the 2p2b decode shape.  All must match the CPU reference.
gemv's kernel comes from shapes (csrc/gemv.cu): M = 1 runs the ring kernel's decode instantiation
(one row a block, 3 stages), M > 1 its general one, and where fewer than two ring stages fit beside
the prologue's rows (sm_120's 99 KB a block: M = 3, K = 18432) the register kernel; so every call
of M > 1 rows is also run one row at a time, which must give the same bits (the same items in
the same order).  Every kernel issues its first weight loads before the programmatic-launch wait
(the only form left)."""
import torch

import torch_kdtree  # noqa: F401
from torch_kdtree.ops import gemv, gemv_reference, moe_gemv, moe_gemv_reference

g = torch.Generator().manual_seed(0)


def rel(a, b):
    return float((a.float().cpu() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def call_gemv(M, K, Ns, prologue, residual, **extra):
    x = torch.randn(M, K, generator=g).bfloat16()
    ws = [(torch.randn(N, K, generator=g) / K ** 0.5).bfloat16() for N in Ns]
    kw = {}
    if prologue == "norm":
        kw["norm_weight"] = (torch.rand(K, generator=g) + 0.5).bfloat16()
    if prologue == "swiglu":
        kw["up"] = torch.randn(M, K, generator=g).bfloat16()
    if residual:
        kw["residual"] = torch.randn(M, Ns[0], generator=g).bfloat16()
    ckw = {k: v.cuda() for k, v in kw.items()}
    xc, wc = x.cuda(), [w.cuda() for w in ws]
    batch = gemv(xc, wc, **ckw, **extra)
    ok = True
    for m in range(M if M > 1 else 0):  # each row alone: the decode instantiation, the same bits
        row_kw = {k: (v[m:m + 1] if k in ("up", "residual") else v) for k, v in ckw.items()}
        ok = ok and all(torch.equal(a, b[m:m + 1]) for a, b in zip(gemv(xc[m:m + 1], wc, **row_kw, **extra), batch))
    want = gemv_reference(x, ws, **kw, **extra)
    ok = ok and all(rel(a, b) < 8e-3 for a, b in zip(batch, want))
    return "OK" if ok else "MISMATCH"


def call_moe(T, k, E, H, I, Is):
    x = torch.randn(T, H, generator=g).bfloat16()
    gate, up = ((torch.randn(E, I, H, generator=g) / H ** 0.5).bfloat16() for _ in range(2))
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=g)
    args = [x, gate, up, down, ids, w]
    if Is:
        args += [(torch.randn(Is, H, generator=g) / H ** 0.5).bfloat16(),
                 (torch.randn(Is, H, generator=g) / H ** 0.5).bfloat16(),
                 (torch.randn(H, Is, generator=g) / Is ** 0.5).bfloat16()]
    got = moe_gemv(*(a.cuda() for a in args))
    ok = rel(got, moe_gemv_reference(*args)) < 8e-3
    return "OK" if ok else "MISMATCH"


print(call_gemv(1, 2048, (1536, 576), "norm", False))
print(call_gemv(5, 264, (40,), "swiglu", True))
print(call_gemv(3, 18432, (96,), "swiglu", False))
print(call_gemv(4, 7168, (300, 8, 24), None, False))
print(call_gemv(1, 7168, (384, 256, 256), "norm", False, fp32_outputs=1, return_input=True))
print(call_gemv(3, 2048, (64,), "norm", False, fp32_outputs=1, return_input=True))
print(call_moe(1, 8, 64, 2048, 512, 512))
print(call_moe(3, 6, 10, 136, 24, 1040))
print(call_moe(2, 3, 8, 256, 64, 0))
torch.cuda.synchronize()
print("done")
