"""Kimi K2.x text model (DeepSeek-V3 architecture) with MLA over a paged latent KV cache.

Parameter names follow transformers' ``DeepseekV3ForCausalLM`` (so state dicts line up), except
the routed experts, which are stacked per projection (moe.py).  Two attention paths:

- prefill (``visible`` is None): the non-absorbed form — K/V expanded per head from the latent,
  causal SDPA; prompts of different lengths are right-padded and given ``input_lengths``.  With a
  cache, the new tokens' latents are written after each request's committed prefix and the
  attention covers prefix + new tokens.
- tree verify / decode (``visible`` given): the absorbed form through
  :func:`torch_kdtree.ops.mla_tree_attention`; node i of request r is written at position
  ``cache.lengths[r] + i`` and sees the committed prefix and its ``visible`` tree nodes.  Every
  shape is fixed by (R, N) and nothing reads device values on the host, so this path runs under
  ``torch.compile(fullgraph=True)`` and CUDA graphs.  Decode is the tree with N = 1.

Neither path moves ``cache.lengths``: the caller commits (``cache.advance``, ``kv_commit``).
Sizes that tensor parallelism changes (heads per rank, experts' intermediate size, vocabulary
shard) are read from weight shapes, so TP is applied from outside.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from torch_kdtree.ops import mla_decode, mla_prepare, mla_tree_attention, mla_tree_attention_output

from ..generation.generate import DDTreeGenerationMixin  # generate(): DDTree / autoregressive loop

from .cache import KimiK2Cache
from .configuration import KimiK2Config, rope_factor, rope_parameters, yarn_mscale
from .fixed_dtype import FixedDtype
from .gemv import fused_gemv, linear, plain_bf16, use_fused, use_gemv_rows
from .moe import KimiK2Experts, KimiK2MLP, KimiK2MoE, KimiK2Router

# DeepSeek's reference code (and transformers) build q_a_layernorm / kv_a_layernorm with the
# RMSNorm default eps, not config.rms_norm_eps (they differ on K2.5: 1e-5).
LATENT_NORM_EPS = 1e-6

# kdtree::mla_prepare / mla_tree_attention_output in tree passes (KimiK2Attention.prepare_op_ok /
# output_op_ok):
# "auto" (default: CUDA, bf16, at most PREPARE_ROWS / OUTPUT_ROWS tokens), "0" (never: the torch
# ops) or "always" (also on CPU and for any pass size, where the ops run their references; tests).
# Read at import, a constant for torch.compile.
_MLA_PREPARE = os.environ.get("KDTREE_MLA_PREPARE", "auto")
if _MLA_PREPARE not in ("auto", "0", "always"):
    raise ValueError(f"KDTREE_MLA_PREPARE must be auto, 0 or always, got {_MLA_PREPARE!r}")
_HAS_MLA_PREPARE_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::mla_prepare", "CUDA")
# Tokens per tree pass (R * N) up to which the ops replace the torch forms: the sizes measured
# faster on the H200 (RESULTS.md, runs 49-50).  mla_prepare at 1 and 4 tokens (3.3-3.7 us against
# inductor's 6.2-8.8); mla_output at 1 token (1.7 us against 1.9-2.1), but at 4 tokens it was slower
# on the K2 rank (3.3 against 2.7 us: it walks the tokens one after another).  Single-token passes
# now take mla_tree_attention_output, whose merge kernel does mla_output's product with the same
# bits and saves the combine launch (run 58: 2p2b 0.6321, k2_slice 0.4038 ms per step, against
# 0.6464 and 0.4108 in run 57).  Larger passes (tree verify) keep the torch forms until measured.
PREPARE_ROWS = 4
OUTPUT_ROWS = 1
# kdtree::mla_decode (mla_prepare, the attention and the W_UV product in one launch) for passes of one
# token (KimiK2Attention.decode_op_ok): "auto" (default: where mla_prepare and the single-token
# output op would run and the latent sizes are K2's), "0" (never: A/B runs) or "always" (any
# one-token-per-request pass, also on CPU where the op runs its reference; tests).  Read at import.
_MLA_DECODE = os.environ.get("KDTREE_MLA_DECODE", "auto")
# Each head's cluster of 8 blocks reads every key of the request (the three-kernel path reads them once
# for all heads), so its time grows faster with the context: in isolation (RESULTS.md, run 76) it beat
# that path up to ~512 keys with 16 heads and ~1024 with 8, and lost 2x at 4096; in the model, with
# an 832-position cache, it saved 2-4 % a step.  Caches larger than this keep the three kernels.
DECODE_MAX_KEYS = 1024
if _MLA_DECODE not in ("auto", "0", "always"):
    raise ValueError(f"KDTREE_MLA_DECODE must be auto, 0 or always, got {_MLA_DECODE!r}")


class KimiK2RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# --------------------------------------------------------------------------------------------
# RoPE (YaRN, interleaved pairs as DeepSeek lays them out)
# --------------------------------------------------------------------------------------------

def yarn_inv_freq(dim: int, base: float, factor: float, original_max_position: int, beta_fast: float,
                  beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """YaRN inverse frequencies: interpolated by ``factor`` below the beta_slow rotation count,
    extrapolated above beta_fast, a linear ramp between (DeepSeek-V3 / transformers' yarn)."""
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extrapolated = 1 - ramp
    return interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated


class KimiK2RotaryEmbedding(FixedDtype):
    """cos/sin (fp32, [..., rope_dim / 2]) of the given positions; ``inv_freq`` stays fp32."""

    fixed_dtype = ("inv_freq",)

    def __init__(self, config: KimiK2Config):
        super().__init__()
        rope = rope_parameters(config)
        dim, base = config.qk_rope_head_dim, rope["rope_theta"]
        if rope["rope_type"] == "yarn":
            factor = rope_factor(config)
            inv_freq = yarn_inv_freq(dim, base, factor, rope["original_max_position_embeddings"],
                                     rope.get("beta_fast") or 32, rope.get("beta_slow") or 1, rope.get("truncate", True))
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            if rope.get("attention_factor") is not None:
                self.attention_factor = float(rope["attention_factor"])
            elif mscale and mscale_all_dim:
                self.attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                self.attention_factor = yarn_mscale(factor)
        else:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
            self.attention_factor = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate pairs of ``x`` [..., d]: interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek) or the
    two halves; the result is laid out as [rotated firsts | rotated seconds] either way (the same
    for queries and keys, so their dot products are the model's).  Computed in fp32."""
    if interleave:
        x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    else:
        x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

class _Prefill(NamedTuple):
    """Per-forward state of the non-absorbed path."""
    cache: Optional[KimiK2Cache]
    slots: Optional[torch.Tensor]  # [M] flat cache slots of the valid new tokens (with a cache)
    valid: Optional[torch.Tensor]  # bool [R, T], the valid new tokens (with a cache)
    key_len: int                   # S, keys per request (cache positions 0..S-1, or the T new tokens)
    mask: torch.Tensor             # bool [R, 1, T, S]


class _Tree(NamedTuple):
    """Per-forward state of the absorbed (tree verify / decode) path."""
    cache: KimiK2Cache
    slots: torch.Tensor            # [R, N] flat cache slots of the N nodes
    visible: torch.Tensor          # bool [R, N, N]


class KimiK2Attention(nn.Module):
    """Multi-head latent attention (kimi_k2.md, MLA); heads per rank come from ``q_b_proj`` /
    ``q_proj`` and ``kv_b_proj`` weight shapes."""

    def __init__(self, config: KimiK2Config):
        super().__init__()
        H, heads = config.hidden_size, config.num_attention_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(H, heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = KimiK2RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = KimiK2RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, H, bias=bias)
        self.softmax_scale = config.softmax_scale
        self.rope_interleave = config.rope_interleave is not False

    def fused_ok(self, h: torch.Tensor, norm: "KimiK2RMSNorm") -> bool:
        """Whether a tree pass over the residual stream ``h`` takes the fused decode path: the
        layer's input ``norm`` inside the q_a / kv_a (or q / kv_a) projections' kernel, q_a_layernorm
        inside q_b's, the residual add inside o_proj's (``kdtree::gemv``, :func:`use_fused`)."""
        projections = (self.q_proj,) if hasattr(self, "q_proj") else (self.q_a_proj, self.q_a_layernorm, self.q_b_proj)
        hooked = self._forward_hooks or self._forward_pre_hooks  # a wrapper expecting normalised input
        return not hooked and use_fused(h, norm, self.kv_a_proj_with_mqa, self.o_proj, *projections)

    def _projections(self, x, norm=None):
        """x [R, T, H] -> q [R, T, h * (dn + dr)] (q_b_proj or q_proj) and ckv [R, T, dc + dr]
        (kv_a_proj_with_mqa).  With ``norm`` (the fused path, :meth:`fused_ok`) x is the residual
        stream and ``norm`` runs inside the kernel of the projections that read it."""
        if norm is not None:
            first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
            q, ckv = fused_gemv(x, [first.weight, self.kv_a_proj_with_mqa.weight], norm.weight, norm.eps)
            if not hasattr(self, "q_proj"):
                (q,) = fused_gemv(q, [self.q_b_proj.weight], self.q_a_layernorm.weight, self.q_a_layernorm.eps)
            return q, ckv
        if hasattr(self, "q_proj"):
            q = linear(self.q_proj, x)
        else:
            q = linear(self.q_b_proj, self.q_a_layernorm(linear(self.q_a_proj, x)))
        return q, linear(self.kv_a_proj_with_mqa, x)

    def _rotate(self, x, q, ckv, cos, sin):
        """(q, ckv) -> q_nope [R, T, h, dn], rotated q_rope [R, T, h, dr], and the cache entries
        ``[kv_a_layernorm(c) | rope(k_rope)]`` [R, T, dc + dr]."""
        q = q.view(*x.shape[:-1], -1, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos[..., None, :], sin[..., None, :], self.rope_interleave)
        c, k_rope = ckv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), apply_rope(k_rope, cos, sin, self.rope_interleave)], dim=-1)
        return q_nope, q_rope, latent

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head W_UK [h, 128, 512] and W_UV [h, 128, 512] (views of ``kv_b_proj.weight``)."""
        w = self.kv_b_proj.weight.view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, layer_idx: int,
                norm: Optional["KimiK2RMSNorm"] = None) -> torch.Tensor:
        """Attention of the normalised hidden states ``x``.  With ``norm`` (tree passes that
        :meth:`fused_ok` accepts), ``x`` is the residual stream itself and the result is
        ``x + attention(norm(x))``, with the norm and the residual add inside the GEMV kernels."""
        if norm is not None and not isinstance(batch, _Tree):
            raise ValueError("KimiK2Attention: the fused norm / residual path is for tree passes only")
        q, ckv = self._projections(x, norm)
        if isinstance(batch, _Tree):
            return self._absorbed(x, q, ckv, cos, sin, batch, layer_idx, residual=x if norm is not None else None)
        return self._expanded(x, *self._rotate(x, q, ckv, cos, sin), batch, layer_idx)

    def _expanded(self, x, q_nope, q_rope, latent, batch: _Prefill, layer_idx):
        """Non-absorbed prefill: K/V per head from the latents of cache positions 0..S-1 (or of
        the new tokens without a cache), causal SDPA."""
        R, T = x.shape[:2]
        if batch.cache is not None:
            batch.cache.write(layer_idx, batch.slots, latent[batch.valid])
            latent = batch.cache.read(layer_idx, batch.key_len).to(x.dtype)
        S = latent.shape[1]
        c, k_rope = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).view(R, S, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        heads = kv.shape[2]
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(R, S, heads, self.qk_rope_head_dim)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=batch.mask, scale=self.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(R, T, heads * self.v_head_dim))

    def prepare_op_ok(self, q: torch.Tensor, cache: KimiK2Cache) -> bool:
        """Whether a tree pass computes the attention query with one ``kdtree::mla_prepare`` launch
        (RoPE, kv_a_layernorm, the cache write, the W_UK absorption): ``KDTREE_MLA_PREPARE`` is
        ``always``, or unset / ``auto`` with the CUDA kernel built, q bf16 on CUDA with at most
        PREPARE_ROWS tokens, a bf16 cache and plain bf16 kv_b_proj / kv_a_layernorm weights (no
        DTensor, no hooks) of the kernel's sizes.  ``0`` keeps the torch ops (A/B runs)."""
        if _MLA_PREPARE == "always":
            return True
        if _MLA_PREPARE != "auto" or not _HAS_MLA_PREPARE_CUDA:
            return False
        rows = q.numel() // q.shape[-1]
        return (q.is_cuda and q.dtype == torch.bfloat16 and cache.kv.dtype == torch.bfloat16 and rows <= PREPARE_ROWS
                and plain_bf16(self.kv_b_proj, self.kv_a_layernorm) and self.kv_lora_rank % 256 == 0
                and self.kv_lora_rank <= 1024 and self.qk_nope_head_dim <= 256 and self.qk_rope_head_dim % 8 == 0
                and self.qk_rope_head_dim <= 256)

    def output_op_ok(self, rows: int, prepared: bool) -> bool:
        """Whether the attention and the heads' values (W_UV) come from one
        ``kdtree::mla_tree_attention_output`` call (its merge kernel does mla_output's product): a pass that
        :meth:`prepare_op_ok` accepted (the same weights, dtypes and devices) with at most
        OUTPUT_ROWS tokens, or ``KDTREE_MLA_PREPARE=always``."""
        return _MLA_PREPARE == "always" or (prepared and rows <= OUTPUT_ROWS)

    def decode_op_ok(self, N: int, rows: int, prepared: bool, cache: KimiK2Cache) -> bool:
        """Whether a pass takes ``kdtree::mla_decode`` (``KDTREE_MLA_DECODE``): one node per
        request, and with ``auto`` a pass that :meth:`prepare_op_ok` and :meth:`output_op_ok`
        accepted, with K2's latent sizes (dc 512, dr 64), dn, dv <= 256 and a cache of at most
        DECODE_MAX_KEYS positions per request (static: its block table's size)."""
        if N != 1 or _MLA_DECODE == "0":
            return False
        if _MLA_DECODE == "always":
            return True
        keys = cache.block_table.shape[1] * cache.page_size
        return (prepared and self.output_op_ok(rows, prepared) and self.kv_lora_rank == 512
                and self.qk_rope_head_dim == 64 and self.qk_nope_head_dim <= 256 and self.v_head_dim <= 256
                and keys <= DECODE_MAX_KEYS)

    def _absorbed(self, x, q, ckv, cos, sin, batch: _Tree, layer_idx, residual=None):
        """Absorbed MLA: q_abs = q_nope W_UK per head, MQA over the latent cache (d_k 576,
        d_v 512), out = o_lat W_UV^T, o_proj (plus ``residual`` in o_proj's kernel, if given)."""
        R, N = x.shape[:2]
        cache = batch.cache
        w_uk, w_uv = self._kv_b()
        prepared = self.prepare_op_ok(q, cache)
        if self.decode_op_ok(N, R * N, prepared, cache):  # the whole core in one launch
            heads = self.kv_b_proj.weight.shape[0] // (self.qk_nope_head_dim + self.v_head_dim)
            out = mla_decode(q.reshape(R, heads, -1), ckv.reshape(R, -1), cos.reshape(R, -1), sin.reshape(R, -1),
                             self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, self.kv_b_proj.weight, cache.kv,
                             layer_idx, batch.slots.reshape(R), cache.block_table, cache.lengths, self.softmax_scale,
                             self.rope_interleave, prefix_ready=True)
            return self._o_proj(out.to(x.dtype).reshape(R, N, -1), residual)
        if prepared:
            M = R * N
            heads = self.kv_b_proj.weight.shape[0] // (self.qk_nope_head_dim + self.v_head_dim)
            q = mla_prepare(q.reshape(M, heads, -1), ckv.reshape(M, -1), cos.reshape(M, -1), sin.reshape(M, -1),
                            self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, self.kv_b_proj.weight, cache.kv,
                            layer_idx, batch.slots.reshape(M), self.rope_interleave).view(R, N, heads, -1)
        else:
            q_nope, q_rope, latent = self._rotate(x, q, ckv, cos, sin)
            cache.write(layer_idx, batch.slots, latent)
            # Decode-sized and compiled on CUDA: the per-head products as multiply + sum, which inductor
            # emits as reduction kernels fused with their neighbours (no copy of q_nope, no batched GEMM).
            if use_gemv_rows(R * N, x, w_uk):
                q_abs = (q_nope.float()[..., :, None] * w_uk.float()).sum(-2).to(x.dtype)
            else:
                q_abs = torch.einsum("rnhd,hdc->rnhc", q_nope, w_uk)
            q = torch.cat([q_abs, q_rope], dim=-1).to(cache.kv.dtype)
        # prefix_ready: the kernels just before this one write only q and the new tokens' rows; the
        # lengths, block table and committed rows date from earlier steps.
        if self.output_op_ok(R * N, prepared):  # the attention and W_UV in one op (one merge-output kernel)
            out = mla_tree_attention_output(q, cache.layer(layer_idx), cache.block_table, cache.lengths, batch.visible,
                                            self.softmax_scale, self.kv_b_proj.weight, self.qk_nope_head_dim,
                                            prefix_ready=True).to(x.dtype)
            return self._o_proj(out.reshape(R, N, -1), residual)
        o_lat = mla_tree_attention(q, cache.layer(layer_idx), cache.block_table, cache.lengths, batch.visible,
                                   self.softmax_scale, prefix_ready=True)
        if use_gemv_rows(R * N, x, w_uv):
            out = (o_lat.float()[..., None, :] * w_uv.float()).sum(-1).to(x.dtype)
        else:
            out = torch.einsum("rnhc,hdc->rnhd", o_lat.to(x.dtype), w_uv)
        return self._o_proj(out.reshape(R, N, -1), residual)

    def _o_proj(self, out: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """o_proj of the heads' values [R, N, h * dv] (plus ``residual`` inside kdtree::gemv's kernel)."""
        if residual is not None:
            return fused_gemv(out, [self.o_proj.weight], residual=residual)[0]
        return linear(self.o_proj, out)


# --------------------------------------------------------------------------------------------
# layers and models
# --------------------------------------------------------------------------------------------

class KimiK2DecoderLayer(nn.Module):
    def __init__(self, config: KimiK2Config, layer_idx: int):
        super().__init__()
        self.self_attn = KimiK2Attention(config)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = KimiK2MoE(config)
        else:
            self.mlp = KimiK2MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = KimiK2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = KimiK2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, batch, layer_idx: int) -> torch.Tensor:
        # Decode-sized bf16 passes on CUDA: the norms and residual adds inside kdtree::gemv launches.
        if isinstance(batch, _Tree) and self.self_attn.fused_ok(h, self.input_layernorm):
            h = self.self_attn(h, cos, sin, batch, layer_idx, norm=self.input_layernorm)
        else:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, layer_idx)
        if isinstance(self.mlp, KimiK2MLP) and self.mlp.fused_ok(h, self.post_attention_layernorm):
            return self.mlp(h, norm=self.post_attention_layernorm, residual=h)
        if isinstance(self.mlp, KimiK2MoE):
            logits = None  # moe_route's logits, computed from x (KimiK2MoE.forward's route_logits)
            if self.mlp.router_fused_ok(h, self.post_attention_layernorm):
                x, routing = self.mlp.route_fused(h, self.post_attention_layernorm)
            elif self.mlp.router_gemv_ok(h, self.post_attention_layernorm):
                x, routing, logits = self.mlp.route_gemv(h, self.post_attention_layernorm)
            else:
                x, routing = self.post_attention_layernorm(h), None
            if self.mlp.fuses_residual(x):  # the residual add inside moe_gemv's / int4_moe's down kernel
                return self.mlp(x, routing=routing, residual=h, route_logits=logits)
            return h + self.mlp(x, routing=routing, route_logits=logits)
        return h + self.mlp(self.post_attention_layernorm(h))


class KimiK2PreTrainedModel(PreTrainedModel):
    config_class = KimiK2Config
    base_model_prefix = "model"
    _no_split_modules = ["KimiK2DecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, KimiK2RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, KimiK2Router):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, KimiK2Experts) and not module.is_int4:
            for p in (module.gate_proj, module.up_proj, module.down_proj):
                p.normal_(0.0, std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a local K2.x safetensors directory (bf16 or compressed-tensors INT4 experts,
        K2.5/K2.6 wrappers included) by streaming it shard by shard; see ``checkpoint.py``."""
        from .checkpoint import from_pretrained

        return from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs)


@dataclass
class KimiK2ModelOutput(ModelOutput):
    """last_hidden_state: final-norm hidden states [R, T, H]; taps: outputs of the requested
    layers concatenated in the requested order, [R, T, len(tap_layers) * H] (None if none)."""
    last_hidden_state: torch.Tensor = None
    taps: Optional[torch.Tensor] = None


@dataclass
class KimiK2CausalLMOutput(ModelOutput):
    """logits [R, T, V_shard] (None with ``return_logits=False``), last_hidden_state and taps as
    in :class:`KimiK2ModelOutput`."""
    logits: Optional[torch.Tensor] = None
    last_hidden_state: torch.Tensor = None
    taps: Optional[torch.Tensor] = None


class KimiK2Model(KimiK2PreTrainedModel):
    def __init__(self, config: KimiK2Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(KimiK2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = KimiK2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = KimiK2RotaryEmbedding(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache: Optional[KimiK2Cache] = None, visible: Optional[torch.Tensor] = None, *,
                input_lengths: Optional[torch.Tensor] = None, tap_layers: Sequence[int] = ()) -> KimiK2ModelOutput:
        """Run the decoder over ``input_ids`` [R, T].

        Tree verify / decode (``visible`` bool [R, N, N] given; ``cache`` and ``positions``
        [R, N] required, positions = committed length + depth): node i is written at
        ``cache.lengths[r] + i`` and attends to the committed prefix and its visible nodes.
        Padding nodes (token -1, seeing only themselves) are computed on token 0; their outputs
        mean nothing.

        Prefill (``visible`` None): causal over each request's committed prefix (with a cache)
        and its new tokens; ``input_lengths`` int [R] marks right padding (default: all T
        tokens), ``positions`` default to ``cache.lengths[r] + t`` (or ``t`` without a cache).
        Eager only (it sizes the attention from the lengths).

        ``tap_layers``: layer indices whose outputs (the residual stream after the layer) are
        returned concatenated, in the given order (the DFlash drafter's context).
        """
        R, T = input_ids.shape
        if visible is not None:
            if cache is None or positions is None:
                raise ValueError("KimiK2Model: a tree pass (visible given) needs a cache and positions "
                                 "(committed length + depth)")
            if tuple(visible.shape) != (R, T, T) or visible.dtype != torch.bool:
                raise ValueError(f"KimiK2Model: visible must be bool [R, N, N] = {(R, T, T)}, got "
                                 f"{visible.dtype} {tuple(visible.shape)}")
            if cache.batch_size != R:
                raise ValueError(f"KimiK2Model: cache holds {cache.batch_size} requests, input_ids has {R}")
            cache.check_room(T)
            batch = _Tree(cache, cache.slots(T), visible.contiguous())
            input_ids = input_ids.clamp(min=0)  # ddtree_build pads with token -1; padding rows see only themselves
        else:
            batch, positions = self._prefill_batch(input_ids, positions, cache, input_lengths)
        if tuple(positions.shape) != (R, T):
            raise ValueError(f"KimiK2Model: positions must be [R, T] = {(R, T)}, got {tuple(positions.shape)}")
        taps_at = {i: n for n, i in enumerate(tap_layers)}
        if len(taps_at) != len(tap_layers) or any(not 0 <= i < len(self.layers) for i in taps_at):
            raise ValueError(f"KimiK2Model: tap_layers must be distinct layer indices in [0, {len(self.layers)}), "
                             f"got {list(tap_layers)}")
        cos, sin = self.rotary_emb(positions)
        h = self.embed_tokens(input_ids)
        taps = [None] * len(tap_layers)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, batch, i)
            if i in taps_at:
                taps[taps_at[i]] = h
        return KimiK2ModelOutput(self.norm(h), torch.cat(taps, dim=-1) if taps else None)

    def _prefill_batch(self, input_ids, positions, cache, input_lengths) -> tuple[_Prefill, torch.Tensor]:
        R, T = input_ids.shape
        device = input_ids.device
        if input_lengths is None:
            input_lengths = torch.full((R,), T, dtype=torch.long, device=device)
        input_lengths = torch.as_tensor(input_lengths, device=device).long()
        if input_lengths.shape != (R,) or (input_lengths < 0).any() or (input_lengths > T).any():
            raise ValueError(f"KimiK2Model: input_lengths must be [R = {R}] values in [0, T = {T}]")
        t = torch.arange(T, device=device)
        valid = t[None, :] < input_lengths[:, None]  # [R, T]
        if cache is None:
            prefix = torch.zeros(R, dtype=torch.long, device=device)
            slots = None
        else:
            if cache.batch_size != R:
                raise ValueError(f"KimiK2Model: cache holds {cache.batch_size} requests, input_ids has {R}")
            cache.check_room(input_lengths)
            prefix = cache.lengths.long()
            rows, cols = valid.nonzero(as_tuple=True)
            slots = cache.slots_at(rows, prefix[rows] + cols)
        if positions is None:
            positions = prefix[:, None] + t[None, :]
        total = prefix + input_lengths  # keys each request has after this pass
        key_len = int(total.max()) if cache is not None else T
        s = torch.arange(key_len, device=device)
        query_at = prefix[:, None] + t[None, :]  # cache position of each new token
        mask = (s[None, None, :] <= query_at[:, :, None]) & (s[None, None, :] < total[:, None, None])
        mask[..., 0] |= ~mask.any(-1)  # a padding row of an empty request: any key, its output is unused
        return _Prefill(cache, slots, valid if cache is not None else None, key_len, mask[:, None]), positions


class KimiK2ForCausalLM(KimiK2PreTrainedModel, DDTreeGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KimiK2Config):
        super().__init__(config)
        self.model = KimiK2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        # Our cache is the paged KimiK2Cache; transformers' generate() runs without one.
        self.generation_config = GenerationConfig.from_model_config(config)
        self.generation_config.use_cache = False

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                cache: Optional[KimiK2Cache] = None, visible: Optional[torch.Tensor] = None, *,
                input_lengths: Optional[torch.Tensor] = None, tap_layers: Sequence[int] = (),
                return_logits: bool = True, attention_mask: Optional[torch.Tensor] = None,
                return_dict: bool = True, use_cache: Optional[bool] = None) -> KimiK2CausalLMOutput:
        """:meth:`KimiK2Model.forward` plus ``lm_head``.  ``return_logits=False`` skips the
        full-vocabulary logits (``last_hidden_state`` is what ``lm_head`` would read), for
        callers that do argmax / top-K themselves or shard the vocabulary.

        ``attention_mask``, ``return_dict`` and ``use_cache`` exist for transformers'
        ``generate()`` (which runs without a cache here); the mask must be all ones — pass
        right-padded ``input_ids`` with ``input_lengths`` instead."""
        if cache is not None and not isinstance(cache, KimiK2Cache):
            raise TypeError(f"KimiK2ForCausalLM: cache must be a KimiK2Cache, got {type(cache).__name__}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("KimiK2ForCausalLM: padded attention_mask is not supported; pass right-padded "
                             "input_ids with input_lengths")
        out = self.model(input_ids, positions, cache, visible, input_lengths=input_lengths, tap_layers=tap_layers)
        logits = self.lm_head(out.last_hidden_state) if return_logits else None
        return KimiK2CausalLMOutput(logits, out.last_hidden_state, out.taps)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}


__all__ = ["KimiK2PreTrainedModel", "KimiK2Model", "KimiK2ForCausalLM", "KimiK2CausalLMOutput", "KimiK2ModelOutput",
           "KimiK2Attention", "KimiK2DecoderLayer", "KimiK2RMSNorm", "KimiK2RotaryEmbedding", "apply_rope",
           "yarn_inv_freq", "LATENT_NORM_EPS"]
