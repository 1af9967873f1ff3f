"""Kimi K2.x text model (DeepSeek-V3 architecture) with MLA over a paged latent KV cache.

Parameter names follow transformers' ``DeepseekV3ForCausalLM`` (so state dicts line up), except
the routed experts, which are stacked per projection (moe.py).  Two attention paths:

- prefill (``visible`` is None): the non-absorbed form — K/V expanded per head from the latent,
  causal attention; prompts of different lengths are right-padded and given ``input_lengths``.
  With a cache, the new tokens' latents are written after each request's committed prefix and the
  attention covers prefix + new tokens.  Prompts longer than ``prefill_chunk_size`` (default
  :data:`PREFILL_CHUNK`, 8192) run in chunks, each attending to the cache and itself, so memory is
  bounded by the chunk (:meth:`KimiK2Attention._expanded` has the arithmetic).
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
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.utils import ModelOutput

from torch_kdtree.ops._checks import value_checks_active

from ..generation.generate import DDTreeGenerationMixin  # generate(): DDTree / autoregressive loop

from . import fused
from .cache import KimiK2Cache
from .configuration import KimiK2Config, rope_factor, rope_parameters, yarn_mscale
from .fixed_dtype import FixedDtype
from .moe import KimiK2Experts, KimiK2MLP, KimiK2MoE, KimiK2Router
from .plan import MLA_FORMS, PassPlan, plan_pass, target_of

# DeepSeek's reference code (and transformers) build q_a_layernorm / kv_a_layernorm with the
# RMSNorm default eps, not config.rms_norm_eps (they differ on K2.5: 1e-5).
LATENT_NORM_EPS = 1e-6

# Prefill (KimiK2Attention._expanded has the memory arithmetic behind these numbers).
PREFILL_CHUNK = 8192                # default prefill_chunk_size: new tokens per prefill pass
PREFILL_MASK_ELEMENTS = 1 << 24     # R * T * S up to which one SDPA call over a bool mask [R, 1, T, S] runs
PREFILL_KV_BYTES = 8 << 30          # one request's K/V expanded over all its S keys, at most (fused SDPA form)
PREFILL_SCORE_ELEMENTS = 1 << 27    # fp32 scores of one key block [R, h, T, K_b] in the blockwise form
# The prefill attention form: "auto" (by size and device, _expanded), or one of PREFILL_FORMS (tests).
PREFILL_ATTENTION = "auto"
PREFILL_FORMS = ("mask", "sdpa", "blocks")


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
    mask: Optional[torch.Tensor]   # bool [R, 1, T, S] ("mask" form only)
    query_at: torch.Tensor         # int64 [R, T]: key position of each new token (prefix + t)
    total: torch.Tensor            # int64 [R]: keys of each request after this pass (prefix + new)
    new: tuple[int, ...] = ()      # per request: valid new tokens (host ints)
    keys: tuple[int, ...] = ()     # per request: keys after this pass (host ints)
    form: str = "mask"             # "mask", or "long": sdpa / blocks chosen per layer (_expanded)
    causal: bool = False           # every request T new tokens, no prefix: plain causal attention


class _Tree(NamedTuple):
    """Per-forward state of the absorbed (tree verify / decode) path."""
    cache: KimiK2Cache
    slots: torch.Tensor            # [R, N] flat cache slots of the N nodes
    visible: torch.Tensor          # bool [R, N, N]
    keys: Optional[int] = None     # positions the torch form reads (None: the block table's reach)


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

    def _projections(self, x):
        """x [R, T, H] -> q [R, T, h * (dn + dr)] (q_b_proj or q_proj) and ckv [R, T, dc + dr]
        (kv_a_proj_with_mqa)."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q, self.kv_a_proj_with_mqa(x)

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, layer_idx: int) -> torch.Tensor:
        """Attention of the normalised hidden states ``x``: the expanded form for a prefill, the
        absorbed form (:meth:`tree_attention`) for a tree pass."""
        q, ckv = self._projections(x)
        q_nope, q_rope, latent = self._rotate(x, q, ckv, cos, sin)
        if isinstance(batch, _Tree):
            return self.o_proj(self.tree_attention(q_nope, q_rope, latent, batch, layer_idx))
        return self._expanded(x, q_nope, q_rope, latent, batch, layer_idx)

    def tree_attention(self, q_nope, q_rope, latent, batch: "_Tree", layer_idx: int) -> torch.Tensor:
        """Absorbed MLA in torch ops, for any latent size: the nodes' cache entries written, then
        per head q_abs = q_nope W_UK, MQA over every position the block table reaches (committed
        positions visible to all, node j at ``lengths + j`` to the nodes that see it), out = o W_UV.
        Returns the heads' values [R, N, h * dv] in q's dtype (fp32 scores and softmax)."""
        cache = batch.cache
        cache.write(layer_idx, batch.slots, latent)
        R, N = q_nope.shape[:2]
        w_uk, w_uv = self._kv_b()
        S = batch.keys or cache.capacity
        keys = cache.read(layer_idx, S)  # [R, S, dc + dr] (dequantised from an fp8 cache)
        # q rounded to the keys' dtype, as the kernels' operands are
        q = torch.cat([torch.einsum("rnhd,hdc->rnhc", q_nope, w_uk), q_rope], dim=-1).to(keys.dtype).float()
        keys = keys.float()
        pos = torch.arange(S, device=q.device)[None, :] - cache.lengths.long()[:, None]  # [R, S], node index if >= 0
        node = pos.clamp(0, N - 1)[:, None, :].expand(R, N, S)
        sees = (pos < 0)[:, None, :] | (batch.visible.gather(2, node) & (pos < N)[:, None, :])  # [R, N, S]
        scores = torch.einsum("rnhc,rsc->rnhs", q, keys) * self.softmax_scale
        p = scores.masked_fill(~sees[:, :, None, :], float("-inf")).softmax(-1)
        o_lat = torch.einsum("rnhs,rsc->rnhc", p, keys[..., : self.kv_lora_rank]).to(q_nope.dtype)
        return torch.einsum("rnhc,hdc->rnhd", o_lat, w_uv).reshape(R, N, -1)

    def _expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [R, S, dc + dr] -> per head K [R, S, h, dn + dr] and V [R, S, h, dv] (kv_b_proj)."""
        R, S = latent.shape[:2]
        c, k_rope = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).view(R, S, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        heads = kv.shape[2]
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(R, S, heads, self.qk_rope_head_dim)], dim=-1)
        return k, v

    def _expanded(self, x, q_nope, q_rope, latent, batch: _Prefill, layer_idx):
        """Non-absorbed prefill: K/V per head from the latents of cache positions 0..S-1 (or of
        the new tokens without a cache), causal attention; query t of request r sees the keys at
        positions <= ``prefix[r] + t``.

        Three forms, the same attention (``batch.form``; "long" picks sdpa or blocks here):

        - ``mask``: one SDPA call over a bool mask [R, 1, T, S] (R * T * S <= PREFILL_MASK_ELEMENTS,
          2^24: the short prompts every caller had before chunking).
        - ``sdpa``: per request, its n new queries against its S keys with SDPA's lower-right causal
          bias (``causal_lower_right(n, S)``: no mask is built; the fused flash / memory-efficient
          kernels stream the scores), on CUDA where those kernels take the shapes and the request's
          K/V expanded over its S keys fit PREFILL_KV_BYTES (8 GiB).  When every request has T new
          tokens and no prefix (``batch.causal``: a first chunk, a training batch), one batched
          SDPA call with ``is_causal=True`` for all of them, on any device (the CPU's flash kernel
          streams too), if the R requests' K/V fit the budget.
        - ``blocks``: keys in blocks of K_b, an online (streaming) softmax in fp32 over the blocks;
          the scores of one block [R, h, T, K_b] <= PREFILL_SCORE_ELEMENTS (2^27, 512 MiB fp32).
          The CPU's form for long prompts after a prefix or with padding, and CUDA's when the fused
          kernels or the budget say no.

        Memory arithmetic, k2_slice (bench/bench_generate.py: one TP-8 rank of K2, h = 8 heads of
        dn + dr = 192 / dv = 128, hidden 7168, 4 layers), one request, S = T = 200k (204,800):
        a one-shot prefill's bool mask [1, 1, T, S] alone is 41.9 GB; SDPA then turns it into a
        bf16 bias (84 GB) or, in its math form, fp32 scores [1, 8, T, S] (1.34 TB).  The K/V
        expansion is not the problem at 8 heads: kv_b_proj's output [S, 8 * 256] and K [S, 8, 192]
        in bf16 are 7,168 B per key, 1.47 GB at 200k and 1.88 GB at 256k (64 heads, full K2 on
        one device: 15 GB at 256k -- hence PREFILL_KV_BYTES, 8 GiB, ~150k keys at 64 heads,
        beyond which the blocks run).  So prompts are prefilled in chunks of T_c
        (PREFILL_CHUNK = 8192) new tokens, each attending
        to the cache (the chunks before it, committed) and to itself: per chunk the residual
        stream [8192, 7168] bf16 is 117 MB (one-shot: 2.9 GB per live copy, 5.9 GB for the RMSNorm's
        fp32 temporaries), the MoE sees 65,536 (token, expert) slots, the latent rows read from the
        cache are [S, 576] (236 MB at 200k in bf16), and attention is the sdpa form (no mask, no
        scores: 1.47 GB of K/V at 200k) or the blocks (K_b = 2^27 / (8 * 8192) = 2048 keys: 512 MiB of
        scores per block plus their exponentials).  Peak prefill memory is then bounded by T_c,
        not T, apart from the O(S) K/V of the sdpa form.
        """
        R, T = x.shape[:2]
        if batch.cache is not None:
            batch.cache.write(layer_idx, batch.slots, latent[batch.valid])
            latent = batch.cache.read(layer_idx, batch.key_len).to(x.dtype)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [R, T, h, dn + dr]
        form = self._prefill_form(batch, q)
        if form == "mask":
            k, v = self._expand_kv(latent)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=batch.mask, scale=self.softmax_scale).transpose(1, 2)
        elif form == "sdpa":
            out = self._attend_causal(q, latent, batch)
        else:
            out = self._attend_blocks(q, latent, batch)
        return self.o_proj(out.reshape(R, T, -1))

    def _prefill_form(self, batch: _Prefill, q: torch.Tensor) -> str:
        """``batch.form``, or for "long": sdpa where the fused SDPA kernels take these shapes and
        the largest request's K/V fit PREFILL_KV_BYTES, else blocks."""
        if batch.form != "long":
            return batch.form
        heads = q.shape[2]
        kv_bytes = max(batch.keys, default=0) * heads * q.element_size() * (
            2 * self.qk_nope_head_dim + self.v_head_dim + self.qk_rope_head_dim)
        if batch.causal and q.shape[0] * kv_bytes <= PREFILL_KV_BYTES:
            return "sdpa"
        if q.device.type == "cuda" and kv_bytes <= PREFILL_KV_BYTES and _fused_sdpa(q, self.v_head_dim):
            return "sdpa"
        return "blocks"

    def _attend_causal(self, q, latent, batch: _Prefill) -> torch.Tensor:
        """The sdpa form: per request, SDPA with a lower-right causal bias (one causal call for all
        when ``batch.causal``); [R, T, h, dv] (zeros at padding queries)."""
        from torch.nn.attention.bias import causal_lower_right

        R, T, heads = q.shape[:3]
        if batch.causal:  # every request: T new tokens, no prefix
            k, v = self._expand_kv(latent[:, :T])
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=self.softmax_scale)
            return out.transpose(1, 2)
        out = q.new_zeros(R, T, heads, self.v_head_dim)
        for r in range(R):
            n, S = batch.new[r], batch.keys[r]
            if n == 0:
                continue
            k, v = self._expand_kv(latent[r : r + 1, :S])
            qr, k, v = q[r : r + 1, :n].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if n == S:
                o = F.scaled_dot_product_attention(qr, k, v, is_causal=True, scale=self.softmax_scale)
            else:  # query i at key position S - n + i (the prefix, then the new tokens)
                o = F.scaled_dot_product_attention(qr, k, v, attn_mask=causal_lower_right(n, S), scale=self.softmax_scale)
            out[r, :n] = o[0].transpose(0, 1)
            del k, v
        return out

    def _attend_blocks(self, q, latent, batch: _Prefill) -> torch.Tensor:
        """The blocks form: keys in blocks of K_b (a multiple of 64) from position 0, K/V expanded
        per block, an online softmax in fp32 (running max, sum and output rescaled per block);
        [R, T, h, dv] in q's dtype."""
        R, T, heads = q.shape[:3]
        S = max(batch.keys, default=0)
        kb = max(64, PREFILL_SCORE_ELEMENTS // max(1, R * heads * T) // 64 * 64)
        qf = q.float().transpose(1, 2)  # [R, h, T, dn + dr]
        m = torch.full((R, heads, T), float("-inf"), device=q.device)
        l = torch.zeros(R, heads, T, device=q.device)
        acc = torch.zeros(R, heads, T, self.v_head_dim, device=q.device)
        query_at, total = batch.query_at[:, None, :, None], batch.total[:, None, None, None]
        for s0 in range(0, S, kb):
            k, v = self._expand_kv(latent[:, s0 : s0 + kb])
            s = torch.arange(s0, s0 + k.shape[1], device=q.device)
            scores = torch.matmul(qf, k.float().permute(0, 2, 3, 1)) * self.softmax_scale  # [R, h, T, K_b]
            scores = scores.masked_fill(~((s <= query_at) & (s < total)), float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1))
            base = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
            p = torch.exp(scores - base[..., None])
            rescale = torch.exp(m - base)
            l = l * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + torch.matmul(p, v.float().transpose(1, 2))
            m = m_new
        out = acc / l.clamp(min=torch.finfo(torch.float32).tiny)[..., None]  # padding rows with no key: 0
        return out.transpose(1, 2).to(q.dtype)


_FUSED_SDPA: dict = {}


def _fused_sdpa(q: torch.Tensor, dv: int) -> bool:
    """Whether SDPA's flash or memory-efficient kernel takes queries / keys of q's head dim and
    values of ``dv`` on q's device and dtype (asked once per shape, with probes laid out as the
    prefill's operands)."""
    heads, dq = q.shape[2], q.shape[3]
    key = (q.device, q.dtype, heads, dq, dv)
    if key not in _FUSED_SDPA:
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        qp = q.new_empty(1, 1, heads, dq).transpose(1, 2)
        kp = q.new_empty(1, 2, heads, dq).transpose(1, 2)
        vp = q.new_empty(1, 2, heads, dv).transpose(1, 2)
        params = SDPAParams(qp, kp, vp, None, 0.0, False, False)
        _FUSED_SDPA[key] = bool(can_use_flash_attention(params) or can_use_efficient_attention(params))
    return _FUSED_SDPA[key]


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
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, layer_idx)
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
                input_lengths: Optional[torch.Tensor] = None, tap_layers: Sequence[int] = (),
                plan: Optional[PassPlan] = None, position_ids: Optional[torch.Tensor] = None,
                prefill_chunk_size: Optional[int] = None) -> KimiK2ModelOutput:
        """Run the decoder over ``input_ids`` [R, T].

        ``positions`` [R, T] are the RoPE positions (any up to the config's window, 262,144 for K2;
        angles are fp32 products of position and frequency, as transformers and DeepSeek compute
        them); ``position_ids`` is the same argument under transformers' name (one or the other),
        and either may be [1, T] for every request, as transformers broadcasts it.

        Tree verify / decode (``visible`` bool [R, N, N] given; ``cache`` and ``positions``
        [R, N] required, positions = committed length + depth): node i is written at
        ``cache.lengths[r] + i`` and attends to the committed prefix and its visible nodes.
        Padding nodes (token -1, seeing only themselves) are computed on token 0; their outputs
        mean nothing.

        Prefill (``visible`` None): causal over each request's committed prefix (with a cache)
        and its new tokens; ``input_lengths`` int [R] marks right padding (default: all T
        tokens), ``positions`` default to ``cache.lengths[r] + t`` (or ``t`` without a cache).
        Eager only (it sizes the attention from the lengths).  More than ``prefill_chunk_size``
        tokens (default :data:`PREFILL_CHUNK`, 8192) run as passes of that many, each attending to
        the cache and itself (:meth:`_prefill_in_chunks`): a 200k-token prompt needs memory for a
        chunk, not for the prompt (``KimiK2Attention._expanded``), with the same outputs.

        ``tap_layers``: layer indices whose outputs (the residual stream after the layer) are
        returned concatenated, in the given order (the DFlash drafter's context).

        ``plan``: the :class:`~.plan.PassPlan` of this pass shape (a generation session plans its
        steps once); None plans it here (:meth:`plan_pass`).
        """
        R, T = input_ids.shape
        positions = _one_positions(positions, position_ids, R)
        if cache is not None:
            _check_cache(cache, input_ids.device)
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
            chunk = prefill_chunk(prefill_chunk_size)
            if T > chunk:
                if plan is not None:
                    raise ValueError(f"KimiK2Model: a plan covers one pass, and this prefill of {T} tokens runs as "
                                     f"passes of prefill_chunk_size = {chunk}; pass plan=None (each pass is "
                                     f"planned) or a prefill_chunk_size >= {T}")
                _check_tap_layers(tap_layers, len(self.layers))
                return self._prefill_in_chunks(input_ids, positions, cache, input_lengths, tap_layers, chunk)
            batch, positions = self._prefill_batch(input_ids, positions, cache, input_lengths)
        if tuple(positions.shape) != (R, T):
            raise ValueError(f"KimiK2Model: positions must be [R, T] = {(R, T)}, got {tuple(positions.shape)}")
        taps_at = _check_tap_layers(tap_layers, len(self.layers))
        if plan is None:
            plan = self.plan_pass(R, T, tree=visible is not None, cache=cache, dtype=self.embed_tokens.weight.dtype,
                                  compiled=torch.compiler.is_compiling())
        elif (plan.tree, plan.tokens, plan.rows) != (visible is not None, T, R * T):
            raise ValueError(f"KimiK2Model: the plan is for {plan.rows} rows of {plan.tokens} tokens "
                             f"({'tree' if plan.tree else 'prefill'}), this pass has R = {R}, T = {T} "
                             f"({'tree' if visible is not None else 'prefill'})")
        elif cache is not None and cache.quantized and any(lp.attention in MLA_FORMS for lp in plan.layers):
            raise ValueError("KimiK2Model: the plan runs MLA kernels, which do not read an fp8 latent cache; "
                             "plan the pass with this cache (model.model.plan_pass(..., cache=cache))")
        if plan.live_keys and isinstance(batch, _Tree):  # eager CPU: read only the positions in use
            page = cache.page_size
            batch = batch._replace(keys=min(cache.capacity, -(-(int(cache.lengths.max()) + T) // page) * page))
        cos, sin = self.rotary_emb(positions)
        h = self.embed_tokens(input_ids)
        tp = getattr(self, "tp", None)
        reduce = tp.all_reduce if tp is not None else None  # the TP hooks' reduction, for the fused forms
        first_rank = tp is None or tp.first_rank  # the rank whose fused epilogues add the residual
        taps = [None] * len(tap_layers)
        for i, layer in enumerate(self.layers):
            lp = plan.layers[i]
            h = layer(h, cos, sin, batch, i) if lp.reference else \
                fused.layer_forward(layer, lp, h, cos, sin, batch, i, reduce, first_rank)
            if i in taps_at:
                taps[taps_at[i]] = h
        return KimiK2ModelOutput(self.norm(h), torch.cat(taps, dim=-1) if taps else None)

    def plan_pass(self, R: int, T: int, *, tree: bool, cache: Optional[KimiK2Cache] = None,
                  dtype: Optional[torch.dtype] = None, compiled: bool = False) -> PassPlan:
        """The :class:`~.plan.PassPlan` of a pass of R requests of T tokens on this model's device
        (a tree pass or a prefill; ``compiled``: under torch.compile), over ``cache``."""
        keys = cache.capacity if cache is not None else 0
        return plan_pass(self, tokens=T, rows=R * T, tree=tree, target=target_of(self.embed_tokens.weight.device,
                                                                                 compiled),
                         dtype=dtype, cache_keys=keys, kv_cache_dtype=cache.kv.dtype if cache is not None else None)

    def _prefill_batch(self, input_ids, positions, cache, input_lengths) -> tuple[_Prefill, torch.Tensor]:
        R, T = input_ids.shape
        device = input_ids.device
        input_lengths = _input_lengths(input_lengths, R, T, device)
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
        query_at = prefix[:, None] + t[None, :]  # cache position of each new token
        if PREFILL_ATTENTION not in ("auto",) + PREFILL_FORMS:
            raise ValueError(f"KimiK2Model: PREFILL_ATTENTION must be 'auto' or one of {PREFILL_FORMS}, "
                             f"got {PREFILL_ATTENTION!r}")
        form = PREFILL_ATTENTION
        if form == "auto":
            form = "mask" if R * T * key_len <= PREFILL_MASK_ELEMENTS else "long"
        if form == "mask":
            s = torch.arange(key_len, device=device)
            mask = (s[None, None, :] <= query_at[:, :, None]) & (s[None, None, :] < total[:, None, None])
            mask[..., 0] |= ~mask.any(-1)  # a padding row of an empty request: any key, its output is unused
            return _Prefill(cache, slots, valid if cache is not None else None, key_len, mask[:, None], query_at,
                            total), positions
        new, keys = tuple(input_lengths.tolist()), tuple(total.tolist())
        causal = all(n == T for n in new) and all(k == T for k in keys)
        return _Prefill(cache, slots, valid if cache is not None else None, key_len, None, query_at, total, new, keys,
                        form, causal), positions

    def _prefill_in_chunks(self, input_ids, positions, cache, input_lengths, tap_layers, chunk: int
                           ) -> KimiK2ModelOutput:
        """A prefill of T > ``chunk`` tokens as ceil(T / chunk) passes of at most ``chunk`` tokens:
        each pass writes its tokens' latents after the ones before it and attends to them (the
        committed lengths are moved forward between passes and restored at the end, so the
        caller still commits).  Without a cache, a scratch cache in the compute dtype holds the
        latents.  The outputs are the passes' concatenated: the same as one pass, to fp32 rounding."""
        R, T = input_ids.shape
        device = input_ids.device
        lengths = _input_lengths(input_lengths, R, T, device)
        scratch = cache is None
        if scratch:
            cache = KimiK2Cache.for_model(self.config, R, T, dtype=self.embed_tokens.weight.dtype, device=device)
        elif cache.batch_size != R:
            raise ValueError(f"KimiK2Model: cache holds {cache.batch_size} requests, input_ids has {R}")
        else:
            cache.check_room(lengths)
        if positions is None:
            positions = cache.lengths.long()[:, None] + torch.arange(T, device=device)[None, :]
        if tuple(positions.shape) != (R, T):
            raise ValueError(f"KimiK2Model: positions must be [R, T] = {(R, T)}, got {tuple(positions.shape)}")
        hidden, taps = [], []
        moved = torch.zeros(R, dtype=torch.long, device=cache.lengths.device)
        try:
            for c0 in range(0, T, chunk):
                c1 = min(c0 + chunk, T)
                n = (lengths - c0).clamp(0, c1 - c0)
                out = self(input_ids[:, c0:c1], positions[:, c0:c1], cache, input_lengths=n, tap_layers=tap_layers,
                           prefill_chunk_size=chunk)
                cache.advance(n)
                moved += n.to(moved.device)
                hidden.append(out.last_hidden_state)
                if out.taps is not None:
                    taps.append(out.taps)
        finally:
            if not scratch:
                cache.lengths.sub_(moved.to(cache.lengths.dtype))
        return KimiK2ModelOutput(torch.cat(hidden, 1), torch.cat(taps, 1) if taps else None)


def _input_lengths(input_lengths, R: int, T: int, device) -> torch.Tensor:
    """int64 [R] lengths of right-padded prompts (default: all T tokens), checked."""
    if input_lengths is None:
        return torch.full((R,), T, dtype=torch.long, device=device)
    input_lengths = torch.as_tensor(input_lengths, device=device).long()
    if input_lengths.shape != (R,) or (value_checks_active(input_lengths)
                                       and bool(((input_lengths < 0) | (input_lengths > T)).any())):
        raise ValueError(f"KimiK2Model: input_lengths must be [R = {R}] values in [0, T = {T}]")
    return input_lengths


def prefill_chunk(prefill_chunk_size) -> int:
    """Tokens per prefill pass: ``prefill_chunk_size`` (a positive int) or, for None,
    :data:`PREFILL_CHUNK`."""
    if prefill_chunk_size is None:
        return PREFILL_CHUNK
    if isinstance(prefill_chunk_size, bool) or not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be a positive int (tokens per prefill pass) or None "
                         f"(default {PREFILL_CHUNK}), got {prefill_chunk_size!r}")
    return prefill_chunk_size


def _check_cache(cache, device: torch.device) -> None:
    """A cache this forward can use: a KimiK2Cache whose tensors form a cache (its check_layout: an
    fp8 cache has its scales, rows of a dtype some path reads) on the inputs' device."""
    if not isinstance(cache, KimiK2Cache):
        raise TypeError(f"KimiK2Model: cache must be a KimiK2Cache, got {type(cache).__name__}")
    cache.check_layout()
    if cache.kv.device != device:
        raise ValueError(f"KimiK2Model: the cache is on {cache.kv.device}, the inputs on {device} "
                         f"(cache.to({str(device)!r}))")


def _check_tap_layers(tap_layers: Sequence[int], layers: int) -> dict[int, int]:
    """{layer index: its place among the taps}, the indices checked distinct and in range."""
    taps_at = {i: n for n, i in enumerate(tap_layers)}
    if len(taps_at) != len(tap_layers) or any(not 0 <= i < layers for i in taps_at):
        raise ValueError(f"KimiK2Model: tap_layers must be distinct layer indices in [0, {layers}), "
                         f"got {list(tap_layers)}")
    return taps_at


def _one_positions(positions: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                   R: int) -> Optional[torch.Tensor]:
    """``positions`` or transformers' ``position_ids`` (refusing both), a [1, T] row expanded to R requests."""
    if position_ids is not None:
        if positions is not None:
            raise ValueError("KimiK2Model: pass positions or position_ids (transformers' name for the same "
                             "argument), not both")
        positions = position_ids
    if positions is not None and positions.dim() == 2 and positions.shape[0] == 1 and R > 1:
        positions = positions.expand(R, -1)
    return positions


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
                return_dict: bool = True, use_cache: Optional[bool] = None,
                plan: Optional[PassPlan] = None, position_ids: Optional[torch.Tensor] = None,
                prefill_chunk_size: Optional[int] = None) -> KimiK2CausalLMOutput:
        """:meth:`KimiK2Model.forward` plus ``lm_head``.  ``return_logits=False`` skips the
        full-vocabulary logits (``last_hidden_state`` is what ``lm_head`` would read), for
        callers that do argmax / top-K themselves or shard the vocabulary.

        ``attention_mask``, ``return_dict`` and ``use_cache`` exist for transformers'
        ``generate()`` (which runs without a cache here); the mask must be all ones — pass
        right-padded ``input_ids`` with ``input_lengths`` instead.  ``position_ids``:
        transformers' name for ``positions`` (one or the other).  ``prefill_chunk_size``: tokens per
        prefill pass (:meth:`KimiK2Model.forward`)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("KimiK2ForCausalLM: padded attention_mask is not supported; pass right-padded "
                             "input_ids with input_lengths")
        out = self.model(input_ids, positions, cache, visible, input_lengths=input_lengths, tap_layers=tap_layers,
                         plan=plan, position_ids=position_ids, prefill_chunk_size=prefill_chunk_size)
        logits = self.lm_head(out.last_hidden_state) if return_logits else None
        return KimiK2CausalLMOutput(logits, out.last_hidden_state, out.taps)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}


__all__ = ["KimiK2PreTrainedModel", "KimiK2Model", "KimiK2ForCausalLM", "KimiK2CausalLMOutput", "KimiK2ModelOutput",
           "KimiK2Attention", "KimiK2DecoderLayer", "KimiK2RMSNorm", "KimiK2RotaryEmbedding", "apply_rope",
           "yarn_inv_freq", "LATENT_NORM_EPS", "PREFILL_CHUNK", "prefill_chunk"]
