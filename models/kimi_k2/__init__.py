"""Kimi K2.x (K2 / K2-Thinking / K2.5 / K2.6 text core): config, model, paged latent KV cache.

Importing registers ``kimi_k2`` with transformers' ``AutoConfig`` (where the name is free) and
:class:`KimiK2ForCausalLM` / :class:`KimiK2Model` for our config with ``AutoModelForCausalLM`` /
``AutoModel``, so ``AutoConfig.from_pretrained(dir)`` and ``AutoModelForCausalLM.from_config``
pick our classes without ``trust_remote_code`` (the ``auto_map`` of shipped K2 configs points at
remote code we never run).  K2.5 / K2.6 directories (``model_type: kimi_k25``, a name
transformers >= 5.17 owns) load through ``KimiK2ForCausalLM.from_pretrained(dir)`` directly.
"""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .cache import CacheOverflowError, KimiK2Cache
from .configuration import KimiK2Config
from .modeling import KimiK2CausalLMOutput, KimiK2ForCausalLM, KimiK2Model, KimiK2ModelOutput, KimiK2PreTrainedModel
from .moe import KimiK2Experts, KimiK2MLP, KimiK2MoE, KimiK2Router


def _register() -> None:
    if KimiK2Config.model_type not in CONFIG_MAPPING:
        AutoConfig.register(KimiK2Config.model_type, KimiK2Config)
    AutoModel.register(KimiK2Config, KimiK2Model, exist_ok=True)
    AutoModelForCausalLM.register(KimiK2Config, KimiK2ForCausalLM, exist_ok=True)


_register()

__all__ = ["KimiK2Config", "KimiK2ForCausalLM", "KimiK2Model", "KimiK2PreTrainedModel", "KimiK2CausalLMOutput",
           "KimiK2ModelOutput", "KimiK2Cache", "CacheOverflowError", "KimiK2Experts", "KimiK2MLP", "KimiK2MoE",
           "KimiK2Router"]
