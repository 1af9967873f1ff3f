"""torch_kdtree: Kimi K2.x with DDTree speculative decoding, PyTorch-native.

Importing the package registers every ``torch.ops.kdtree`` op: schemas (C++), CPU kernels (the
pure-torch references in :mod:`torch_kdtree.ops`), fake kernels for ``torch.compile``, and the
CUDA kernels when the extension was built with them.  Nothing else: transformers is not imported.

The model package lives in the repository's top-level ``models/`` folder and is importable as
``torch_kdtree.models``; it loads on first use (``import torch_kdtree.models``, or the attribute
``torch_kdtree.models``), and that first import registers the model classes with transformers'
Auto* classes.
"""
import importlib.util
import os
import sys

import torch

from . import _C  # noqa: F401  (registers the kdtree:: schemas and the CUDA kernels)


class _SourceModelsFinder:
    """Finds ``torch_kdtree.models`` in a source checkout: ``models/`` beside the package."""

    def __init__(self, src: str) -> None:
        self.src = src

    def find_spec(self, name, path=None, target=None):
        if name != "torch_kdtree.models":
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(self.src, "__init__.py"), submodule_search_locations=[self.src])


def _mount_source_models() -> None:
    """In a source checkout ``models/`` sits beside the package; installs map it inside.  Only a
    finder is installed here: the models (and transformers) load when first imported."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(here, "models")):
        return
    src = os.path.join(os.path.dirname(here), "models")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        return
    if not any(type(f).__name__ == _SourceModelsFinder.__name__ for f in sys.meta_path):
        sys.meta_path.append(_SourceModelsFinder(src))


_mount_source_models()

from . import ops  # noqa: E402,F401  (registers CPU and fake kernels)


def __getattr__(name: str):
    # PEP 562: ``torch_kdtree.models`` imports the models (and transformers) on first access.
    if name == "models":
        return importlib.import_module(".models", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"models"})


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
