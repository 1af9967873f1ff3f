"""DFlash block-diffusion drafter (z-lab format): config, model with a static context KV cache, writer."""
from .configuration import DFlashConfig, default_target_layer_ids
from .modeling import DFlashDraftModel
from .writer import random_drafter, write_random_drafter

__all__ = ["DFlashConfig", "DFlashDraftModel", "default_target_layer_ids", "random_drafter", "write_random_drafter"]
