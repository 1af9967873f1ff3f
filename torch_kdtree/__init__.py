"""torch_kdtree: Kimi K2.x with DDTree speculative decoding, PyTorch-native.

Importing the package registers every ``torch.ops.kdtree`` op: schemas (C++), CPU kernels (the
pure-torch references in :mod:`torch_kdtree.ops`), fake kernels for ``torch.compile``, and the
CUDA kernels when the extension was built with them.  The model package lives in the
repository's top-level ``models/`` folder and is importable as ``torch_kdtree.models``.
"""
import importlib.util
import os
import sys

import torch

from . import _C  # noqa: F401  (registers the kdtree:: schemas and the CUDA kernels)


def _mount_source_models() -> None:
    """In a source checkout ``models/`` sits beside the package; installs map it inside."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(here, "models")) or "torch_kdtree.models" in sys.modules:
        return
    src = os.path.join(os.path.dirname(here), "models")
    init = os.path.join(src, "__init__.py")
    if os.path.isfile(init):
        spec = importlib.util.spec_from_file_location("torch_kdtree.models", init, submodule_search_locations=[src])
        module = importlib.util.module_from_spec(spec)
        sys.modules["torch_kdtree.models"] = module
        spec.loader.exec_module(module)


_mount_source_models()

from . import ops  # noqa: E402,F401  (registers CPU and fake kernels)
from . import models  # noqa: E402,F401  (registers the model classes with transformers' Auto*)


def build_info() -> dict:
    """What this build holds: whether CUDA kernels are compiled in, and for which architectures."""
    archs = _C.cuda_archs()
    return {
        "cuda_kernels": bool(archs),
        "cuda_archs": [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }


__all__ = ["ops", "models", "build_info"]
__version__ = "0.1.0"
