"""Device probe: does a TORCH_CHECK thrown from an nvcc-compiled extension reach Python?"""
import os
import sys

import torch
from torch.utils import cpp_extension

which = sys.argv[1] if len(sys.argv) > 1 else "tiny"
if which == "tiny":
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    cpp_extension.load("thr", [os.path.join(os.path.dirname(__file__), "throw_probe.cu")], is_python_module=False)
    try:
        torch.ops.thr.f(torch.zeros(2), 9)
    except RuntimeError as e:
        print("tiny: caught", str(e)[:60])
else:
    import torch_kdtree  # noqa: F401
    lp = torch.zeros(1, 2, 2, device="cuda")
    ids = torch.zeros(1, 2, 2, dtype=torch.long, device="cuda")
    try:
        torch.ops.kdtree.ddtree_build(lp, ids, torch.zeros(1, dtype=torch.long, device="cuda"), 2000)
    except RuntimeError as e:
        print("kdtree: caught", str(e)[:60])
