"""Persistent-chain probe (GPU diagnostic): one launch for a chain of dependent GEMVs vs one each.

What a one-launch, cross-phase weight stream saves over one kernel per dependent GEMV.

The decode step is a chain of dependent, bandwidth-bound GEMVs (M = 1).  This script times chains
of bf16 GEMVs y_p = W_p · y_{p-1}, each captured in a CUDA graph, against the bandwidth floor
measured in the same run (bytes of all W_p / the read bandwidth of bench/conftest.py):
  - ``gemv``: one ``kdtree::gemv`` launch per phase (the library's decode kernel, PDL on);
  - ``p_w{W}_s{S}[_nobarrier][_noxload][_strided]``: persistent_chain_probe.cu (next to this file),
    one launch for the whole chain, W warps per SM and S 2 KB ring stages per warp; ``_nobarrier``
    and ``_noxload`` drop the grid barriers / the reload of x (wrong results: the stream's own
    speed), ``_strided`` hands items out strided instead of in contiguous ranges.
Chains: ``k2_like`` (K2 TP-8 rank shapes 7168 -> 1536 -> 1536 -> 7168, 4 layers, 195 MB),
``2p2b_like`` (2048 -> 1536 -> 3072 -> 2048, 4 layers, 113 MB), ``big`` (two 7168 x 7168 phases,
206 MB) and ``tiny`` (12 phases of 0.5 MB: the cost of the dependency itself).  Each line also gives
the largest relative difference of the chain's last output from the gemv chain's (bf16 rounding of
another summation order when the variant is exact; large for the wrong-result switches).

Run from the repository root (GPU, after the library's build; the probe builds with
torch.utils.cpp_extension.load, ~1 min the first time):
    PYTHONPATH=. python bench/persistent_chain_probe.py [chain ...]
bench/RESULTS.md runs 111-116 have its numbers.
"""
import argparse
import os

import torch

from bench.conftest import cuda_time_us, hbm_ceiling

HERE = os.path.dirname(os.path.abspath(__file__))

# (k_0, n_0), (k_1 = n_0, n_1), ...: phase p's weight is [n_p, k_p]
CHAINS = {
    "k2_like": [(7168, 1536), (1536, 1536), (1536, 7168)] * 4,
    "2p2b_like": [(2048, 1536), (1536, 3072), (3072, 2048)] * 4,
    "big": [(7168, 7168), (7168, 7168)],
    "tiny": [(1024, 256), (256, 1024)] * 6,
}
# (warps, stages, barrier, x load, strided)
VARIANTS = [(16, 3, True, True, False), (16, 3, True, True, True), (16, 4, True, True, True),
            (8, 8, True, True, True), (16, 2, False, False, True), (16, 3, False, True, True),
            (16, 3, True, False, True)]


def build():
    from torch.utils.cpp_extension import load

    root = os.path.dirname(HERE)
    return load(name="kdtree_persistent_chain_probe", sources=[os.path.join(HERE, "persistent_chain_probe.cu")],
                extra_include_paths=[os.path.join(root, "torch_kdtree", "csrc")],
                extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr"], verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chains", nargs="*", metavar="chain", help=f"of {', '.join(CHAINS)} (default: all)")
    args = parser.parse_args()
    unknown = [c for c in args.chains if c not in CHAINS]
    if unknown:
        parser.error(f"unknown chain(s) {unknown}; choose from {list(CHAINS)}")
    if not torch.cuda.is_available():
        raise SystemExit("persistent_chain_probe needs a CUDA device")
    from torch_kdtree.ops import gemv

    probe = build()
    read_gbs = hbm_ceiling().gbs
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.chains or list(CHAINS):
        shapes = CHAINS[name]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5 for k, n in shapes]
        x0 = torch.randn(shapes[0][0], device="cuda", dtype=torch.bfloat16, generator=g)
        counters = torch.zeros(len(ws), device="cuda", dtype=torch.int32)
        floor_us = sum(w.numel() * 2 for w in ws) / (read_gbs * 1e9) * 1e6

        def gemv_chain():
            y = x0.view(1, -1)
            for w in ws:
                y = gemv(y, [w])[0]
            return y.view(-1)

        ref = gemv_chain()
        runs = {"gemv": gemv_chain}
        for wn, s, bar, xl, st in VARIANTS:
            label = f"p_w{wn}_s{s}" + ("" if bar else "_nobarrier") + ("" if xl else "_noxload") + ("_strided" if st else "")
            runs[label] = (lambda wn=wn, s=s, bar=bar, xl=xl, st=st:
                           probe.run_chain(x0, ws, counters, wn, s, sms, bar, xl, st)[-1])
        for label, fn in runs.items():
            out = fn()
            torch.cuda.synchronize()
            if out.dtype == torch.float32:  # the probe's partials
                out = out.sum(0).to(torch.bfloat16)
            err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
            us = cuda_time_us(fn, calls_per_graph=5, replays=10)
            print(f"PROBE {name} {label}: {us:.2f} us per chain, floor {floor_us:.2f} us (ceiling {read_gbs:.0f} GB/s), "
                  f"floor ratio {floor_us / us:.3f}, rel diff from the gemv chain {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
