"""HF-style models: Kimi K2 target and DFlash drafter (installed as torch_kdtree.models)."""
from .dflash import DFlashConfig, DFlashDraftModel  # noqa: F401
