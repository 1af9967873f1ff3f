"""The sizes the planner needs, read once from a ``config.json`` dict (plain json, no transformers).

- :class:`TargetShape`: a DeepSeek-V3-family (MLA) text model; K2.5 / K2.6 wrappers are
  unwrapped here (``text_config``) as models/kimi_k2/configuration.py's ``text_core`` does,
  which this package cannot import (it pulls in transformers).
- :class:`WeightFormat`: the checkpoint's ``quantization_config``: bf16, compressed-tensors
  packed INT-n with group scales, or DeepSeek-style block FP8.
- :class:`VisionShape`: the K2.5 / K2.6 vision tower and projector (a parameter estimate).
- :class:`DrafterShape`: a DFlash drafter (Qwen3 layers, GQA attention).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "config.json"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def read_config(spec: str, presets: dict, what: str) -> tuple[str, dict, Path | None]:
    """(label, config dict, directory or None) of a preset name, a ``config.json`` path, or a
    directory holding one.  Raises ValueError naming what was wrong."""
    from .presets import preset_config

    if spec in presets:
        return spec, preset_config(presets, spec), None
    path = Path(spec)
    directory = path if path.is_dir() else path.parent
    if path.is_dir():
        path = path / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{what} {spec!r} is neither a preset ({', '.join(presets)}) nor a config.json file "
                         "or a directory holding one")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what} {path}: a config.json holds a JSON object")
    return str(path), config, directory


def _field(d: dict, key: str, where: str):
    if d.get(key) is None:
        raise ValueError(f"{where}: config.json has no {key!r}")
    return d[key]


@dataclass(frozen=True)
class WeightFormat:
    """How the checkpoint stores its quantised weights (``kind`` bf16, int or fp8)."""

    kind: str = "bf16"
    bits: int = 16
    group_size: int = 0             # int: inputs per bf16 scale
    block: tuple[int, int] = (0, 0)  # fp8: (rows, cols) per fp32 scale

    @classmethod
    def from_quantization_config(cls, qc) -> "WeightFormat":
        if not qc:
            return cls()
        method = qc.get("quant_method")
        if method == "fp8":
            block = qc.get("weight_block_size")
            if not block or len(block) != 2:
                raise ValueError("quantization_config: fp8 without a 2-d weight_block_size is not supported")
            return cls("fp8", 8, 0, (int(block[0]), int(block[1])))
        if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
            groups = list((qc.get("config_groups") or {}).values())
            if len(groups) != 1 or not isinstance(groups[0].get("weights"), dict):
                raise ValueError("quantization_config: one compressed-tensors weight scheme expected")
            w = groups[0]["weights"]
            if w.get("type", "int") != "int" or w.get("strategy") != "group" or not w.get("group_size"):
                raise ValueError(f"quantization_config: only grouped integer weights are supported, got {w}")
            return cls("int", int(w["num_bits"]), int(w["group_size"]))
        raise ValueError(f"quantization_config: quant_method {method!r} / format {qc.get('format')!r} is not "
                         "supported (bf16, compressed-tensors pack-quantized, block fp8)")

    def describe(self) -> str:
        if self.kind == "int":
            return f"INT{self.bits} group-{self.group_size}"
        if self.kind == "fp8":
            return f"FP8 {self.block[0]}x{self.block[1]} blocks"
        return "bf16"


@dataclass(frozen=True)
class VisionShape:
    """MoonViT + patch-merger projector (K2.5 / K2.6), sized from ``vision_config``."""

    hidden: int
    intermediate: int
    layers: int
    patch: int
    pos_emb: int          # learned position-embedding rows (height x width)
    merge: int            # patches merged into one projector input (kh x kw)
    text_hidden: int

    @classmethod
    def from_config(cls, v: dict, text_hidden: int) -> "VisionShape":
        hidden = int(v.get("vt_hidden_size") or v.get("hidden_size") or 1152)
        kh, kw = v.get("merge_kernel_size") or (2, 2)
        return cls(hidden=hidden, intermediate=int(v.get("vt_intermediate_size") or v.get("intermediate_size") or 4304),
                   layers=int(v.get("vt_num_hidden_layers") or v.get("num_hidden_layers") or 27),
                   patch=int(v.get("patch_size") or 14),
                   pos_emb=int(v.get("init_pos_emb_height") or 64) * int(v.get("init_pos_emb_width") or 64),
                   merge=int(kh) * int(kw), text_hidden=int(v.get("text_hidden_size") or text_hidden))

    @property
    def parameters(self) -> int:
        """Weights and biases of the ViT blocks (fused qkv + o, GELU MLP, two LayerNorms), the patch
        embedding, the position table and the projector (LayerNorm, merged -> merged -> text hidden)."""
        h, i, m = self.hidden, self.intermediate, self.merge * self.hidden
        block = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
        patch = 3 * self.patch * self.patch * h + h
        projector = 2 * h + m * m + m + m * self.text_hidden + self.text_hidden
        return self.layers * block + patch + self.pos_emb * h + projector


@dataclass(frozen=True)
class TargetShape:
    """A DeepSeek-V3-family text model (MLA attention, routed + shared experts)."""

    hidden: int
    layers: int
    dense_layers: int
    dense_intermediate: int
    moe_intermediate: int
    experts: int
    shared_experts: int
    heads: int
    q_lora: int | None
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    vocab: int
    max_positions: int
    tied_embeddings: bool
    weights: WeightFormat
    vision: VisionShape | None

    @classmethod
    def from_config(cls, d: dict, where: str = "model") -> "TargetShape":
        text = d["text_config"] if isinstance(d.get("text_config"), dict) else d
        if not text.get("kv_lora_rank"):
            raise ValueError(f"{where}: no kv_lora_rank in config.json; the planner sizes MLA (DeepSeek-V3 family) "
                             "targets only")
        if text.get("moe_layer_freq", 1) != 1:
            raise ValueError(f"{where}: moe_layer_freq={text['moe_layer_freq']} (only every layer past "
                             "first_k_dense_replace being MoE is supported)")
        qc = text.get("quantization_config") or d.get("quantization_config")
        hidden = int(_field(text, "hidden_size", where))
        vision = d.get("vision_config")
        return cls(
            hidden=hidden, layers=int(_field(text, "num_hidden_layers", where)),
            dense_layers=int(text.get("first_k_dense_replace") or 0),
            dense_intermediate=int(_field(text, "intermediate_size", where)),
            moe_intermediate=int(_field(text, "moe_intermediate_size", where)),
            experts=int(_field(text, "n_routed_experts", where)), shared_experts=int(text.get("n_shared_experts") or 0),
            heads=int(_field(text, "num_attention_heads", where)),
            q_lora=int(text["q_lora_rank"]) if text.get("q_lora_rank") else None,
            kv_lora=int(text["kv_lora_rank"]), qk_nope=int(_field(text, "qk_nope_head_dim", where)),
            qk_rope=int(_field(text, "qk_rope_head_dim", where)), v_head=int(_field(text, "v_head_dim", where)),
            vocab=int(_field(text, "vocab_size", where)),
            max_positions=int(text.get("max_position_embeddings") or 0),
            tied_embeddings=bool(text.get("tie_word_embeddings", False)),
            weights=WeightFormat.from_quantization_config(qc),
            vision=VisionShape.from_config(vision, hidden) if isinstance(vision, dict) else None,
        )

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def latent_dim(self) -> int:
        """Values the latent cache keeps per token and layer: the compressed KV plus the shared rope key."""
        return self.kv_lora + self.qk_rope


def _safetensors_shape(directory: Path, names: tuple[str, ...]) -> list[int] | None:
    """A tensor's shape from ``model.safetensors``'s JSON header (no tensor data is read)."""
    file = directory / "model.safetensors"
    if not file.is_file():
        return None
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    for name in names:
        if name in header:
            return header[name]["shape"]
    return None


@dataclass(frozen=True)
class DrafterShape:
    """A DFlash drafter: Qwen3 layers with GQA attention; embedding and lm_head borrowed from the target."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    taps: int
    block_size: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, d: dict, directory: Path | None = None, where: str = "drafter") -> "DrafterShape":
        archs = d.get("architectures")
        if archs is not None and "DFlashDraftModel" not in archs:
            raise ValueError(f"{where}: architectures {archs!r} has no DFlashDraftModel")
        dflash = d.get("dflash_config") or {}
        layers, heads = int(_field(d, "num_hidden_layers", where)), int(_field(d, "num_attention_heads", where))
        inter = d.get("intermediate_size")
        if inter is None and directory is not None:  # public files may omit it: read the MLP's shape
            names = ("layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight")
            shape = _safetensors_shape(directory, names)
            inter = shape[0] if shape else None
        if inter is None:
            raise ValueError(f"{where}: config.json has no intermediate_size (and no model.safetensors beside it)")
        taps = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "bfloat16").removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{where}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        return cls(hidden=int(_field(d, "hidden_size", where)), layers=layers, heads=heads,
                   kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=int(d.get("head_dim") or 128),
                   intermediate=int(inter), taps=len(taps) if taps else layers,  # DFlash's default: one tap per layer
                   block_size=int(dflash.get("block_size", d.get("block_size", 16))), dtype_bytes=DTYPE_BYTES[dtype])

    @property
    def depths(self) -> int:
        """L: tokens proposed per draft (block positions after the root)."""
        return self.block_size - 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["read_config", "WeightFormat", "VisionShape", "TargetShape", "DrafterShape", "ceil_div"]
