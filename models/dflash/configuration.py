"""DFlash drafter configuration: the public ``config.json`` format, read and written.

A public DFlash checkpoint (z-lab's Qwen3 / Kimi K2.5 / K2.6 drafters) carries a Qwen3 config
plus DFlash keys (see docs/dflash.md).  :meth:`DFlashConfig.from_dict` is the one place that
knows the format's quirks (``block_size`` nested or at the top level, ``rope_scaling`` versus
``rope_parameters``, ``deepseek_yarn``) and refuses, by name, everything that would change the
math of the forward implemented in :mod:`.modeling`.
"""
from __future__ import annotations

import copy
import json
import math
import os
import warnings
from dataclasses import dataclass, field

import torch

from ..kimi_k2.checkpoint_files import read_config_json

CONFIG_NAME = "config.json"
ARCHITECTURE = "DFlashDraftModel"

# Qwen3Config defaults: a file that omits a field means these values.
_QWEN3_DEFAULT_THETA = 10_000.0
_QWEN3_DEFAULT_HEAD_DIM = 128
_QWEN3_DEFAULT_RMS_EPS = 1e-6
_QWEN3_DEFAULT_MAX_POSITIONS = 32768

_ROPE_TYPES = ("default", "yarn", "deepseek_yarn")
# dflash_config keys the forward understands; other keys there are DFlash-specific behaviour.
_DFLASH_KEYS = {"target_layer_ids", "mask_token_id", "block_size"}
# Keys that change the forward's math unless they hold the neutral value given here.
_NEUTRAL_KEYS = {
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "is_causal": False,
    "attention_bias": False,
    "mlp_bias": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "partial_rotary_factor": 1.0,
    "rope_is_neox_style": True,
    "is_neox_style": True,
}
# Keys of other drafter families (DFlash2's convolutions and candidate selector, MLA attention).
_FOREIGN_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "kv_lora_rank",
                 "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps: ``round(1 + i (N - 4) / (n - 1))`` for i < n, ``[N // 2]`` when n = 1.

    Python's ``round`` (half to even), as in the reference implementation.
    """
    if num_draft_layers < 1:
        raise ValueError(f"DFlash: num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"DFlash: the default target_layer_ids need num_target_layers >= 4, got {num_target_layers}")
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _neutral(value, neutral) -> bool:
    if neutral is None:
        return value is None or value == 0
    return value == neutral


def _refuse_changed_math(d: dict) -> None:
    """Raise on every config entry whose meaning this forward does not implement."""
    archs = d.get("architectures") or []
    if "DFlash2DraftModel" in archs:
        raise ValueError("DFlash: DFlash2DraftModel checkpoints (convolutions + candidate selector) are not "
                         "supported; only DFlashDraftModel is")
    if ARCHITECTURE not in archs:
        raise ValueError(f"DFlash: config.json architectures must contain {ARCHITECTURE!r}, got {archs!r}")
    dflash = d.get("dflash_config") or {}
    scopes = (("config.json", d), ("dflash_config", dflash))
    for where, scope in scopes:
        for key, neutral in _NEUTRAL_KEYS.items():
            if key in scope and not _neutral(scope[key], neutral):
                raise ValueError(f"DFlash: {where} sets {key}={scope[key]!r}; only {neutral!r} is supported")
        for key in _FOREIGN_KEYS:
            if scope.get(key) is not None:
                raise ValueError(f"DFlash: {where} sets {key} (another drafter or attention family); not supported")
        for key, value in scope.items():
            if "sink" in key.lower() and value:
                raise ValueError(f"DFlash: {where} sets {key}={value!r}; attention sinks are not supported")
            if key.lower() in ("attention_type", "attn_type", "attention_mode", "attn_mode") and value not in (
                    None, "full_attention", "mha", "gqa"):
                raise ValueError(f"DFlash: {where} sets {key}={value!r}; only full (GQA) attention is supported")
    layer_types = d.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"DFlash: config.json layer_types={layer_types!r}; only 'full_attention' layers "
                         "(non-causal block attention) are supported")
    unknown = sorted(set(dflash) - _DFLASH_KEYS - set(_NEUTRAL_KEYS))
    if unknown:
        warnings.warn(f"DFlash: ignoring unknown dflash_config keys {unknown}", stacklevel=3)


def _read_rope(d: dict) -> dict:
    """RoPE parameters with transformers' semantics: ``rope_parameters`` (new) or ``rope_scaling`` +
    top-level ``rope_theta`` (old).  K2.6's ``deepseek_yarn`` is YaRN with mscale = mscale_all_dim = 1."""
    rope = d.get("rope_parameters")
    if rope is None:
        rope = d.get("rope_scaling")
    rope = dict(rope or {})
    rope_type, legacy_type = rope.pop("rope_type", None), rope.pop("type", None)
    rope_type = rope_type or legacy_type or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"DFlash: rope_type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
    theta = rope.pop("rope_theta", None)
    if theta is None:
        theta = d.get("rope_theta", _QWEN3_DEFAULT_THETA)
    out = {"rope_type": rope_type, "rope_theta": float(theta)}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"DFlash: partial_rotary_factor={rope['partial_rotary_factor']} is not supported "
                         "(the drafter rotates the full head_dim)")
    rope.pop("partial_rotary_factor", None)
    if rope.get("attention_factor") is not None:  # transformers ignores it for default RoPE; we honour it
        out["attention_factor"] = float(rope.pop("attention_factor"))
    if rope_type == "default":
        return out
    if rope_type == "deepseek_yarn":
        rope.setdefault("mscale", 1.0)
        rope.setdefault("mscale_all_dim", 1.0)
    if "original_max_position_embeddings" not in rope:
        raise ValueError("DFlash: YaRN rope parameters need original_max_position_embeddings")
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate"):
        if key in rope:
            out[key] = rope.pop(key)
    if rope:
        warnings.warn(f"DFlash: ignoring unknown rope parameters {sorted(rope)}", stacklevel=3)
    if out.get("factor") is None:
        out["factor"] = d.get("max_position_embeddings", _QWEN3_DEFAULT_MAX_POSITIONS) / float(
            out["original_max_position_embeddings"])
    return out


@dataclass
class DFlashConfig:
    """Shape and semantics of a DFlash drafter.

    ``target_layer_ids`` are indices of target decoder layers whose *outputs* are tapped (their
    concatenation, tap-major, feeds ``fc``); ``block_size`` = 1 root + (block_size - 1) mask
    positions, so the drafter proposes L = block_size - 1 depths.  ``rope_parameters`` follows
    transformers (``rope_type``, ``rope_theta`` and the YaRN keys); set its ``attention_factor``
    to override the cos/sin amplitude that the file implies (docs/dflash.md, open question).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int | None  # None: taken from the checkpoint's MLP weights when loading
    vocab_size: int | None  # the target's (borrowed); None: unknown, not checked
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    head_dim: int = _QWEN3_DEFAULT_HEAD_DIM
    block_size: int = 16
    rms_norm_eps: float = _QWEN3_DEFAULT_RMS_EPS
    max_position_embeddings: int = _QWEN3_DEFAULT_MAX_POSITIONS
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": _QWEN3_DEFAULT_THETA})
    dtype: str | None = "bfloat16"

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise ValueError("DFlash: target_layer_ids must not be empty")
        if self.num_target_layers is not None:
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if bad:
                raise ValueError(f"DFlash: target_layer_ids {bad} outside [0, num_target_layers={self.num_target_layers})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DFlash: num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DFlash: head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(f"DFlash: block_size must be >= 2 (a root and at least one mask), got {self.block_size}")
        if self.mask_token_id < 0 or self.vocab_size is not None and self.mask_token_id >= self.vocab_size:
            raise ValueError(f"DFlash: mask_token_id={self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        rope = dict(self.rope_parameters)
        if rope.get("rope_type", "default") not in _ROPE_TYPES:
            raise ValueError(f"DFlash: rope_type {rope.get('rope_type')!r} is not supported")
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", _QWEN3_DEFAULT_THETA)
        self.rope_parameters = rope

    # ---- derived shapes ----
    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_draft_depths(self) -> int:
        """L: the draft proposes one marginal per block position 1 .. block_size - 1."""
        return self.block_size - 1

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return None if self.dtype is None else getattr(torch, self.dtype)

    # ---- the public file format ----
    @classmethod
    def from_dict(cls, d: dict) -> "DFlashConfig":
        _refuse_changed_math(d)
        dflash = d.get("dflash_config") or {}
        n_layers = int(d["num_hidden_layers"])
        n_target = d.get("num_target_layers")
        taps = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if taps is None:
            if n_target is None:
                raise ValueError("DFlash: config.json has neither dflash_config.target_layer_ids nor num_target_layers")
            taps = default_target_layer_ids(int(n_target), n_layers)
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ValueError("DFlash: config.json has no dflash_config.mask_token_id")
        block = dflash.get("block_size", d.get("block_size", 16))  # nested (newer files) wins
        heads = int(d["num_attention_heads"])
        dtype = d.get("dtype", d.get("torch_dtype"))
        return cls(
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            intermediate_size=None if d.get("intermediate_size") is None else int(d["intermediate_size"]),
            vocab_size=None if d.get("vocab_size") is None else int(d["vocab_size"]),
            mask_token_id=int(mask),
            target_layer_ids=list(taps),
            num_target_layers=None if n_target is None else int(n_target),
            head_dim=int(d.get("head_dim") or _QWEN3_DEFAULT_HEAD_DIM),
            block_size=int(block),
            rms_norm_eps=float(d.get("rms_norm_eps", _QWEN3_DEFAULT_RMS_EPS)),
            max_position_embeddings=int(d.get("max_position_embeddings", _QWEN3_DEFAULT_MAX_POSITIONS)),
            rope_parameters=_read_rope(d),
            dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )

    def to_dict(self) -> dict:
        """The public format (as z-lab's Kimi drafters write it: top-level ``rope_theta``,
        ``rope_scaling`` for non-default RoPE, ``block_size`` nested in ``dflash_config``)."""
        rope = copy.deepcopy(self.rope_parameters)
        d = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": rope.pop("rope_theta"),
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size},
        }
        for key in ("intermediate_size", "vocab_size", "num_target_layers"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if rope["rope_type"] != "default" or len(rope) > 1:
            d["rope_scaling"] = rope
        if self.dtype is not None:
            d["dtype"] = self.dtype
        return d

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DFlashConfig":
        file = os.path.join(path, CONFIG_NAME)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"DFlash: no {CONFIG_NAME} in {path}")
        return cls.from_dict(read_config_json(path))  # a truncated file: CheckpointError naming it

    def save_pretrained(self, path: str | os.PathLike) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def rope_inv_freq(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [head_dim / 2] and the cos/sin amplitude, as transformers'
    default and YaRN RoPE initialisers compute them (computed on the CPU, once)."""
    rope = config.rope_parameters
    dim, base = config.head_dim, rope["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim)
    if rope["rope_type"] == "default":
        return 1.0 / pos_freqs, float(rope.get("attention_factor") or 1.0)

    factor = float(rope["factor"])
    original = rope["original_max_position_embeddings"]

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    amplitude = rope.get("attention_factor")
    if amplitude is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        amplitude = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
            else get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(amplitude)
