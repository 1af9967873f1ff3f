"""Small random Kimi K2.x checkpoints in exactly the formats Moonshot ships (for tests and benchmarks).

``write_random_checkpoint(dir, {...overrides...}, int4=True, num_shards=3)`` writes

* ``config.json`` of the K2 family: ``model_type`` ``kimi_k2``, ``architectures``
  ``["DeepseekV3ForCausalLM"]``, the shipped ``auto_map``, YaRN ``rope_scaling``, noaux_tc
  routing fields and, for ``int4=True``, K2-Thinking's ``quantization_config``
  (compressed-tensors, ``pack-quantized``, int4 symmetric group-32 weights on every routed
  expert, the rest listed in ``ignore``); sizes scaled down by :data:`SMALL_SIZES` unless
  overridden;
* ``model.safetensors`` (one shard) or ``model.safetensors.index.json`` and shards named like
  the K2 repositories' (``model-00001-of-000062.safetensors``: five digits, then six), split
  by bytes so that a layer's experts straddle shard boundaries;
* INT4 routed experts packed as compressed-tensors packs them (eight 4-bit values per int32
  along the input dimension, lowest nibble first, each stored as q + 8; bf16 scales per 32
  inputs; ``weight_shape`` = [out, in]); every other tensor bf16, ``e_score_correction_bias``
  fp32;
* with ``k25_wrapper=True`` the K2.5 / K2.6 layout: a ``kimi_k25`` config whose ``text_config``
  holds the text model (and its ``quantization_config``), ``language_model.``-prefixed tensor
  names, and a few vision-tower / projector tensors the text model must skip.

Tensor values depend only on ``seed`` and the tensor's name, not on the sharding.  Shards are
generated and written one at a time, so large benchmark checkpoints never sit in memory whole.
"""
from __future__ import annotations

import copy
import json
import math
import os
import zlib
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from .checkpoint_files import (CONFIG_NAME, EXPERT_PROJECTIONS, INDEX_FILE, INT4_BITS, INT4_GROUP_SIZE,
                               INT4_PER_INT32, LANGUAGE_MODEL_PREFIX, SINGLE_FILE)

# K2-Thinking's quantization_config as shipped: every Linear is int4 except what ``ignore`` lists,
# which leaves exactly the routed experts quantised.
K2_QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": INT4_GROUP_SIZE,
                "num_bits": INT4_BITS, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                "symmetric": True, "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# The text model's config.json as the K2 repositories ship it (full size).
K2_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

# K2.5 / K2.6: a vision-language wrapper around the same text model.
K25_WRAPPER_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "auto_map": {
        "AutoConfig": "configuration_kimi_k25.KimiK25Config",
        "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    },
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "ignore_index": -100,
    "media_placeholder_token_id": 163605,
    "model_type": "kimi_k25",
    "pad_token_id": 163839,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "vision_config": {
        "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64, "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool", "mm_hidden_size": 1152, "mm_projector_type": "patchmerger", "patch_size": 14,
        "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
        "text_hidden_size": 7168, "video_attn_type": "spatial_temporal", "vt_hidden_size": 1152,
        "vt_intermediate_size": 4304, "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
    },
}
# What K2.5's text_config differs in from K2-Thinking's config.
K25_TEXT_CHANGES = {
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
}
K25_IGNORE_EXTRA = ["re:.*vision_tower.*", "re:.*mm_projector.*"]

# Scaled-down sizes for tests.  The INT4 kernels need hidden_size a multiple of 128 (channels per
# CTA) and moe_intermediate_size a multiple of 64 (k per weight tile), see ops/moe.py.
SMALL_SIZES = {
    "vocab_size": 512, "bos_token_id": 256, "eos_token_id": 258, "hidden_size": 128, "intermediate_size": 128,
    "moe_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 16, "num_experts_per_tok": 4,
}

Int4Encoder = Callable[[torch.Tensor, torch.Tensor], dict]


def k2_config_dict(overrides: dict | None = None, *, int4: bool = True, small: bool = True) -> dict:
    """The K2 text model's ``config.json``: K2-Thinking's, scaled down by :data:`SMALL_SIZES`, then ``overrides``."""
    config = copy.deepcopy(K2_CONFIG)
    if small:
        config.update(SMALL_SIZES)
    config.update(copy.deepcopy(overrides or {}))
    config.pop("quantization_config", None)
    if int4:
        config["quantization_config"] = copy.deepcopy(K2_QUANTIZATION_CONFIG)
    return config


def _overrides_of(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    values = config.to_dict()  # a KimiK2Config: keep the K2 fields it sets
    skip = ("architectures", "auto_map", "model_type", "transformers_version", "torch_dtype")
    out = {k: values[k] for k in K2_CONFIG if k in values and k not in skip}
    dtype = values.get("torch_dtype") or values.get("dtype")
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    rope = values.get("rope_scaling") or values.get("rope_parameters")
    if rope:  # transformers 5 keeps RoPE as rope_parameters (with rope_theta inside); K2 files use rope_scaling
        rope = dict(rope)
        if rope.get("rope_theta") is not None:
            out["rope_theta"] = rope.pop("rope_theta")
        rope.pop("rope_theta", None)
        kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
        rope.pop("type", None)
        out["rope_scaling"] = None if kind == "default" else {**rope, "type": kind}
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [..., in] -> int32 [..., in / 8]: value k at bits 4(k % 8), stored as q + 8."""
    if q.dtype != torch.int8 or q.shape[-1] % INT4_PER_INT32:
        raise ValueError(f"pack_int4 needs int8 with a last dimension divisible by 8, got {q.dtype} {list(q.shape)}")
    nibbles = (q.to(torch.int32) + 8).unflatten(-1, (-1, INT4_PER_INT32))
    words = nibbles[..., 0].clone()
    for j in range(1, INT4_PER_INT32):  # int32 shifts wrap into the sign bit, as the format wants
        words |= nibbles[..., j] << (INT4_BITS * j)
    return words


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 [..., in / 8] -> int8 [..., in] in [-8, 7]."""
    shifts = torch.arange(0, 32, INT4_BITS, dtype=torch.int32, device=words.device)
    return (((words.unsqueeze(-1) >> shifts) & 0xF) - 8).to(torch.int8).flatten(-2)


def compressed_tensors_layout(q: torch.Tensor, scale: torch.Tensor) -> dict:
    """Our packing of one projection: the three tensors compressed-tensors stores per quantised Linear."""
    return {"weight_packed": pack_int4(q), "weight_scale": scale.to(torch.bfloat16),
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int32)}


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _tensor_specs(config: dict, int4: bool) -> list[tuple[str, tuple, str]]:
    """(name, shape, kind) of every tensor of the text model, in the order the K2 shards hold them."""
    h, v = config["hidden_size"], config["vocab_size"]
    heads, nope, rope, vdim = (config["num_attention_heads"], config["qk_nope_head_dim"], config["qk_rope_head_dim"],
                               config["v_head_dim"])
    q_lora, kv_lora = config.get("q_lora_rank"), config["kv_lora_rank"]
    inter, moe_inter = config["intermediate_size"], config["moe_intermediate_size"]
    experts = config.get("n_routed_experts") or 0
    specs = [("model.embed_tokens.weight", (v, h), "embedding")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]
        a = p + "self_attn."
        if q_lora:
            specs += [(a + "q_a_proj.weight", (q_lora, h), "linear"), (a + "q_a_layernorm.weight", (q_lora,), "norm"),
                      (a + "q_b_proj.weight", (heads * (nope + rope), q_lora), "linear")]
        else:
            specs += [(a + "q_proj.weight", (heads * (nope + rope), h), "linear")]
        specs += [(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h), "linear"),
                  (a + "kv_a_layernorm.weight", (kv_lora,), "norm"),
                  (a + "kv_b_proj.weight", (heads * (nope + vdim), kv_lora), "linear"),
                  (a + "o_proj.weight", (h, heads * vdim), "linear")]
        moe = experts and i >= config.get("first_k_dense_replace", 0) and i % config.get("moe_layer_freq", 1) == 0
        m = p + "mlp."
        if not moe:
            specs += [(m + "gate_proj.weight", (inter, h), "linear"), (m + "up_proj.weight", (inter, h), "linear"),
                      (m + "down_proj.weight", (h, inter), "linear")]
            continue
        specs += [(m + "gate.weight", (experts, h), "linear"), (m + "gate.e_score_correction_bias", (experts,), "bias")]
        shapes = {"gate_proj": (moe_inter, h), "up_proj": (moe_inter, h), "down_proj": (h, moe_inter)}
        for e in range(experts):
            for proj in EXPERT_PROJECTIONS:
                base = f"{m}experts.{e}.{proj}"  # int4: _make appends .weight_packed / _scale / _shape
                specs.append((base, shapes[proj], "int4") if int4 else (base + ".weight", shapes[proj], "linear"))
        shared = moe_inter * config.get("n_shared_experts", 0)
        if shared:
            s = m + "shared_experts."
            specs += [(s + "gate_proj.weight", (shared, h), "linear"), (s + "up_proj.weight", (shared, h), "linear"),
                      (s + "down_proj.weight", (h, shared), "linear")]
    specs += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "linear")]
    return specs


_VISION_SPECS = [("vision_tower.patch_embed.proj.weight", (16, 3, 2, 2), "linear"),
                 ("vision_tower.encoder.final_layernorm.weight", (16,), "norm"),
                 ("mm_projector.proj.0.weight", (64, 64), "linear")]


def _spec_bytes(shape: tuple, kind: str) -> int:
    n = math.prod(shape)
    if kind == "int4":  # packed int32 + bf16 scales + int32 shape
        return n // 2 + 2 * n // INT4_GROUP_SIZE + 8
    return 4 * n if kind == "bias" else 2 * n


def _make(name: str, shape: tuple, kind: str, seed: int, dtype: torch.dtype, encode: Int4Encoder | None) -> dict:
    g = _generator(seed, name)
    if kind == "norm":
        return {name: (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)}
    if kind == "bias":
        return {name: 0.1 * torch.randn(shape, generator=g)}          # fp32, as shipped
    if kind == "embedding":
        return {name: torch.randn(shape, generator=g).to(dtype)}
    if kind == "linear":
        return {name: (torch.randn(shape, generator=g) / math.sqrt(shape[-1])).to(dtype)}
    out, inp = shape
    # Uniform random words are the packing of uniform random q in [-8, 7] (every nibble independent).
    words = torch.randint(-2**31, 2**31, (out, inp // INT4_PER_INT32), generator=g, dtype=torch.int32)
    # |q| ~ 4.6 on average: scales around 1/(4.6 sqrt(in)) give unit-variance outputs.
    scale = ((0.5 + torch.rand(out, inp // INT4_GROUP_SIZE, generator=g)) / (4.6 * math.sqrt(inp))).to(torch.bfloat16)
    if encode is None:
        tensors = {"weight_packed": words, "weight_scale": scale,
                   "weight_shape": torch.tensor([out, inp], dtype=torch.int32)}
    else:
        tensors = encode(unpack_int4(words), scale)
    return {f"{name}.{k}": t for k, t in tensors.items()}


def write_random_checkpoint(path: str | os.PathLike, config=None, *, int4: bool = True, num_shards: int = 2,
                            k25_wrapper: bool = False, seed: int = 0, small: bool = True,
                            dtype: torch.dtype = torch.bfloat16, int4_encoder: Int4Encoder | None = None) -> dict:
    """Write a random K2.x checkpoint directory; returns the ``config.json`` written.

    ``config``: ``None``, a dict of ``config.json`` overrides, or a ``KimiK2Config`` (its K2
    fields are copied).  ``small=False`` starts from the full K2 sizes instead of
    :data:`SMALL_SIZES`.  ``int4_encoder(q int8 [out, in], scale bf16 [out, in/32])`` returns the
    tensors stored per quantised projection (default: the layout of :func:`compressed_tensors_layout`,
    written straight from random words; tests pass the compressed-tensors package's own compressor).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = k2_config_dict(_overrides_of(config), int4=int4, small=small)
    specs = _tensor_specs(text, int4)
    if k25_wrapper:
        text.update(copy.deepcopy(K25_TEXT_CHANGES))
        if int4:
            text["quantization_config"]["ignore"] += K25_IGNORE_EXTRA
        for key in ("architectures", "auto_map", "transformers_version"):
            text.pop(key, None)
        written = copy.deepcopy(K25_WRAPPER_CONFIG)
        written["text_config"] = text
        written["vision_config"]["text_hidden_size"] = text["hidden_size"]
        if small:  # keep the special tokens inside the scaled-down vocabulary
            written.update(bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"] - 1,
                           pad_token_id=text["vocab_size"] - 1)
        specs = _VISION_SPECS + [(LANGUAGE_MODEL_PREFIX + n, s, k) for n, s, k in specs]
    else:
        written = text
    (path / CONFIG_NAME).write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")

    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    sizes = [_spec_bytes(s, k) for _, s, k in specs]
    total = sum(sizes)
    shard_of, start = [], 0
    for size in sizes:  # a tensor goes where its first byte falls: layers straddle shard boundaries
        shard_of.append(min(num_shards - 1, start * num_shards // total))
        start += size
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard in range(num_shards):
        fname = SINGLE_FILE if num_shards == 1 else f"model-{shard + 1:05d}-of-{num_shards:06d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for (name, shape, kind), where in zip(specs, shard_of):
            if where == shard:
                tensors.update(_make(name, shape, kind, seed, dtype, int4_encoder))
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        total_size += sum(t.nbytes for t in tensors.values())
        del tensors
    if num_shards > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return written
