"""Kimi K2.x configuration: the text core of K2 / K2-Thinking / K2.5 / K2.6 checkpoints.

A K2 ``config.json`` is a DeepSeek-V3 config with ``model_type: kimi_k2`` (docs/kimi_k2.md),
so :class:`KimiK2Config` is transformers' ``DeepseekV3Config`` under our model type, plus:

- K2.5 / K2.6 wrap the same text core in a vision-language model (``model_type: kimi_k25``):
  the text fields (and ``quantization_config``) live in ``text_config`` and tensor names carry a
  ``language_model.`` prefix, recorded in :attr:`KimiK2Config.tensor_prefix` for the loader.
- RoPE arrives as ``rope_scaling`` (K2 files, ``type: yarn``) or ``rope_parameters`` (configs
  written by transformers 5); ``rope_type: deepseek_yarn`` is YaRN.  :func:`rope_parameters`
  reads either form once, and :func:`yarn_mscale` / :meth:`KimiK2Config.softmax_scale` derive
  the attention scale from it.
- Routing must be ``noaux_tc`` with sigmoid scores, every layer past ``first_k_dense_replace``
  MoE, SiLU MLPs (the only math this model implements); anything else is refused by name
  instead of being run wrong.
"""
from __future__ import annotations

import copy
import math
from typing import Any

from transformers import DeepseekV3Config

WRAPPER_TENSOR_PREFIX = "language_model."
# Fields that change the math; the model implements exactly these values (absent = this value).
_REQUIRED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}


def _normalise_rope(rope: Any) -> Any:
    if isinstance(rope, dict):
        rope = dict(rope)
        for key in ("rope_type", "type"):
            if rope.get(key) == "deepseek_yarn":  # K2.6-era files: same YaRN, DeepSeek's name for it
                rope[key] = "yarn"
    return rope


def text_core(config_dict: dict) -> dict:
    """The K2 text-model fields of a ``config.json`` dict (K2.5/K2.6 wrappers unwrapped).

    Returns a new dict; a wrapper's ``text_config`` comes back with ``tensor_prefix`` set to
    ``"language_model."`` and the wrapper's ``quantization_config`` when the text core has none.
    """
    d = copy.deepcopy(config_dict)
    text = d.get("text_config")
    if isinstance(text, dict):
        outer = d
        d = copy.deepcopy(text)
        d.setdefault("tensor_prefix", WRAPPER_TENSOR_PREFIX)
        if "quantization_config" in outer and "quantization_config" not in d:
            d["quantization_config"] = outer["quantization_config"]
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if key in outer and key not in d:
                d[key] = outer[key]
    d.pop("model_type", None)  # kimi_k2 / deepseek_v3 / kimi_k25 all become ours
    d.pop("auto_map", None)  # remote code we never run; our registration must win
    for key in ("rope_scaling", "rope_parameters"):
        if key in d:
            d[key] = _normalise_rope(d[key])
    return d


class KimiK2Config(DeepseekV3Config):
    r"""Configuration of the Kimi K2.x text model (DeepSeek-V3 architecture).

    Reads a real K2 / K2-Thinking ``config.json`` (``model_type`` ``kimi_k2`` or ``deepseek_v3``)
    or a K2.5 / K2.6 wrapper (``kimi_k25``, text core in ``text_config``).  Every DeepSeek-V3
    field keeps transformers' meaning; extra fields kept from the file:

    - ``quantization_config``: the file's dict as is (compressed-tensors ``pack-quantized`` for
      the INT4 checkpoints); the loader interprets it.
    - ``tensor_prefix``: ``"language_model."`` for the VLM wrappers, else ``""``.
    - ``topk_method`` / ``scoring_func`` / ``moe_layer_freq``: must be ``noaux_tc`` /
      ``sigmoid`` / 1 (or absent).
    """

    model_type = "kimi_k2"

    def __post_init__(self, **kwargs):
        kwargs.setdefault("tensor_prefix", "")
        for key, want in _REQUIRED.items():
            got = kwargs.get(key, want)
            if got != want:
                raise ValueError(f"KimiK2Config: {key}={got!r} is not supported (Kimi K2 has {key}={want!r})")
            kwargs[key] = got
        if self.hidden_act != "silu":
            raise ValueError(f"KimiK2Config: hidden_act={self.hidden_act!r} is not supported (Kimi K2 uses 'silu')")
        for key in ("rope_scaling", "rope_parameters"):
            if key in kwargs:
                kwargs[key] = _normalise_rope(kwargs[key])
        self.rope_parameters = _normalise_rope(self.rope_parameters)
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        return {**text_core(config_dict), "model_type": cls.model_type}, kwargs

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        return super().from_dict(text_core(config_dict), **kwargs)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("tensor_prefix", None)  # a fact about the directory it was read from, not the model
        return out

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: ``qk_head_dim^-0.5 * m^2`` with YaRN's ``m`` (docs/kimi_k2.md)."""
        rope = rope_parameters(self)
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            m = yarn_mscale(rope_factor(self), rope["mscale_all_dim"])
            scale *= m * m
        return scale


def rope_parameters(config) -> dict:
    """The RoPE parameters of ``config`` as one dict with ``rope_type`` and ``rope_theta``,
    whether the config holds ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope = _normalise_rope(dict(rope))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if rope["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"Kimi K2: rope_type {rope['rope_type']!r} is not supported (default or yarn)")
    return rope


def rope_factor(config) -> float:
    rope = rope_parameters(config)
    factor = rope.get("factor")
    if factor is None:  # as DeepSeek-V3: the ratio of the context lengths
        factor = config.max_position_embeddings / rope["original_max_position_embeddings"]
    return float(factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude factor ``0.1 * mscale * ln(scale) + 1`` (1 when not scaling up)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


__all__ = ["KimiK2Config", "text_core", "rope_parameters", "rope_factor", "yarn_mscale", "WRAPPER_TENSOR_PREFIX"]
