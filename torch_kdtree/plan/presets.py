"""Named GPUs, models and drafters the planner knows, each with where its numbers come from.

Models are the fields of the public ``config.json`` files that size memory, not whole files
(``--model`` also takes a real ``config.json``).  The K2 text core is the same in every preset
(docs/kimi_k2.md; models/kimi_k2/writer.py holds a full copy of K2-Thinking's file, which
this stdlib-only package cannot import); what differs is the weight format, the position limit
and the K2.5 / K2.6 vision tower.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

GiB = 1 << 30
MiB = 1 << 20

# What the driver keeps for itself on an H200: nvidia-smi's 143,771 MiB total against the 139.81 GiB
# that cudaMemGetInfo (and so vLLM's memory fraction) sees.  Used for cards with no public CUDA total.
DRIVER_RESERVED = 143_771 * MiB - round(139.81 * GiB)


@dataclass(frozen=True)
class GpuPreset:
    name: str
    total_bytes: int  # what cudaMemGetInfo reports as total: the base of --mem-fraction
    source: str


GPUS = {
    "h200": GpuPreset("NVIDIA H200 141 GB", round(139.81 * GiB),
                      "vLLM's memory profile on an H200 prints total_gpu_memory (139.81GiB); nvidia-smi: 143,771 MiB"),
    "h100": GpuPreset("NVIDIA H100 SXM 80 GB", round(79.11 * GiB),
                      "vLLM V1 memory profiles on H100 80 GB print total_gpu_memory (79.11GiB) (up to 79.33 by "
                      "driver); nvidia-smi: 81,559 MiB"),
    "b200": GpuPreset("NVIDIA B200 180 GB", 183_359 * MiB - DRIVER_RESERVED,
                      "nvidia-smi: 183,359 MiB, less the 0.59 GiB the driver keeps on an H200 (assumed: no public "
                      "CUDA total found)"),
    "rtx-pro-6000": GpuPreset("NVIDIA RTX PRO 6000 Blackwell 96 GB", 97_887 * MiB - DRIVER_RESERVED,
                              "nvidia-smi: 97,887 MiB, less the 0.59 GiB the driver keeps on an H200 (assumed: no "
                              "public CUDA total found)"),
}


# ---------------------------------------------------------------------------- models

# The text core of every K2.x checkpoint (public config.json of moonshotai/Kimi-K2-Instruct,
# Kimi-K2-Thinking, and text_config of Kimi-K2.5).
_K2_TEXT = {
    "hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 1, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "tie_word_embeddings": False, "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
# K2-Thinking / K2.5 / K2.6: compressed-tensors INT4, group 32, routed experts only (the rest is in `ignore`).
_INT4_GROUP32 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}
# K2-Instruct ships DeepSeek-V3's block FP8: every projection e4m3 with an fp32 scale per 128 x 128 block.
_FP8_BLOCK128 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# K2.5's vision tower (MoonViT) and patch-merger projector, as its config.json names them.
_K25_VISION = {
    "vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_hidden_layers": 27, "vt_num_attention_heads": 16,
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "merge_kernel_size": [2, 2],
    "mm_hidden_size": 1152, "text_hidden_size": 7168, "mm_projector_type": "patchmerger",
}


@dataclass(frozen=True)
class ModelPreset:
    name: str
    config: dict = field(repr=False)
    source: str = ""


def _wrapped(text: dict) -> dict:
    """The K2.5 / K2.6 layout: a kimi_k25 wrapper with the text core (and its quantisation) in text_config."""
    return {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": {**text, "model_type": "kimi_k2"}, "vision_config": dict(_K25_VISION)}


MODELS = {
    "kimi-k2": ModelPreset(
        "Kimi K2 Instruct", {**_K2_TEXT, "max_position_embeddings": 131072, "quantization_config": _FP8_BLOCK128},
        "moonshotai/Kimi-K2-Instruct config.json (131,072 positions, YaRN factor 32; block-FP8 weights)"),
    "kimi-k2-thinking": ModelPreset(
        "Kimi K2 Thinking", {**_K2_TEXT, "quantization_config": _INT4_GROUP32},
        "moonshotai/Kimi-K2-Thinking config.json (262,144 positions; INT4 group-32 routed experts)"),
    "kimi-k2.5": ModelPreset(
        "Kimi K2.5", _wrapped({**_K2_TEXT, "quantization_config": _INT4_GROUP32}),
        "moonshotai/Kimi-K2.5 config.json: K2-Thinking's text core in text_config, plus a MoonViT vision tower"),
    "kimi-k2.6": ModelPreset(
        "Kimi K2.6", _wrapped({**_K2_TEXT, "quantization_config": _INT4_GROUP32}),
        "assumed equal to Kimi K2.5 in every size (same text core and wrapper, docs/kimi_k2.md); "
        "its RoPE naming differs, which costs no memory"),
}


# ---------------------------------------------------------------------------- drafters

# z-lab/Kimi-K2.5-DFlash (docs/dflash.md): Qwen3 layers, the target's embedding and lm_head borrowed.
_K25_DFLASH = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "num_hidden_layers": 6,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 18432,
    "vocab_size": 163840, "num_target_layers": 61, "dtype": "bfloat16",
    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838, "block_size": 8},
}

DRAFTERS = {
    "kimi-k2.5-dflash": ModelPreset(
        "Kimi K2.5 DFlash", _K25_DFLASH,
        "z-lab/Kimi-K2.5-DFlash: 6 layers, 64/8 heads of 128, intermediate 18432 (from the file size), 6 taps, "
        "block 8"),
    "kimi-k2.6-dflash": ModelPreset(
        "Kimi K2.6 DFlash", _K25_DFLASH,
        "z-lab/Kimi-K2.6-DFlash is a gated preview: assumed shaped as the K2.5 drafter"),
}


def preset_config(presets: dict, name: str) -> dict:
    """A copy of a preset's config (callers may change it)."""
    return copy.deepcopy(presets[name].config)


__all__ = ["GiB", "MiB", "GPUS", "MODELS", "DRAFTERS", "GpuPreset", "ModelPreset", "preset_config",
           "DRIVER_RESERVED"]
