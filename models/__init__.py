"""HF-style models: Kimi K2 target and DFlash drafter (installed as torch_kdtree.models)."""
# ---- Kimi K2 ----
from .kimi_k2 import KimiK2Cache, KimiK2Config, KimiK2ForCausalLM, KimiK2Model  # noqa: F401  (registers Auto*)
# ---- DFlash ----
from .dflash import DFlashConfig, DFlashDraftModel  # noqa: F401
# ---- the trained default pair (python -m training.run) ----
from .pair import load_default_pair  # noqa: F401
