"""DFlash block-diffusion drafter with a static, device-resident context KV cache.

Forward of one draft call (docs/dflash.md): the block ``[root, MASK x (bs - 1)]`` is embedded
with the *target's* embedding at positions ``start .. start + bs - 1`` (``start`` = the
request's context length), runs through pre-norm Qwen3 layers whose attention is non-causal
over [context K/V, block K/V], and ``norm`` + the target's ``lm_head`` at block positions
1 .. bs - 1 give the L = bs - 1 per-depth marginals.

The context (target taps of committed tokens -> ``fc`` -> ``hidden_norm``) never runs through
the layers: each layer keeps ``k_norm(k_proj(ctx))`` (RoPE'd at its absolute position) and
``v_proj(ctx)``.  Those live in a fixed-capacity cache, per layer ``[R, S, Hkv, D]`` with
``S = capacity + block_size`` rounded up to 16: slots ``[0, len)`` hold context, the step's
block K/V are written at ``[len, len + bs)`` and attended in place (then dropped: the length
does not move), and slot ``S - 1`` doubles as the sink for rows an append leaves out.  Every
shape is fixed by (R, capacity, block_size), nothing reads device data on the host (except the
eager-only value checks of :mod:`torch_kdtree.ops._checks`), so append and forward can sit
inside one CUDA graph.
"""
from __future__ import annotations

import copy
import functools
import os
import warnings

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from torch_kdtree.ops import gemm_rows
from torch_kdtree.ops._checks import value_checks_active

from ..kimi_k2.checkpoint_files import SAFETENSORS_DTYPES, read_safetensors_header
from ..kimi_k2.gemv import gemm_rows_takes, linears
from .configuration import DFlashConfig, rope_inv_freq

WEIGHTS_NAME = "model.safetensors"
_SLOT_ALIGN = 16  # cache length multiple: keeps the attention mask's rows aligned for fused kernels


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, cast back, scale by the weight (no +1 offset)."""

    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R, T, heads, D]; cos, sin [R, T, D] in x's dtype (half-split over the full head_dim)."""
    return x * cos.unsqueeze(2) + _rotate_half(x) * sin.unsqueeze(2)


# ---- attention over the live slots only ----
# The context cache has a fixed capacity (every shape static, so a step can be captured), but
# a step must not read what it does not hold: the masked SDPA below reads all S slots of every
# layer whatever the context (run 180, H200: a k2_slice DDTree step with a 262k-token cache
# took 6.8 ms at a 1k context against 1.2 ms with a 2k-token cache).  On CUDA the block's
# queries instead attend through flash attention's variable-length form, whose ``seqused_k``
# (read on the device) stops each key segment at the request's live length: each request's live
# slots are cut into P partitions (segments of the packed [R * S] key rows whose starts and
# lengths are device values), and the partitions' outputs are merged by their log-sum-exp in
# float32 (flash decoding).  P grows with the capacity and shrinks with the requests x heads that
# already fill the GPU.  (Static partitions of the capacity left a 16k context to 2 of 32
# partitions, 16 CTAs walking 8,192 keys each: 785 us against 457 at 1k, run 182.)
_PART_MIN_SLOTS = 512
_PART_TARGET_CTAS = 256


def _flash_seqused_available() -> bool:
    """True when this torch's flash attention takes ``seqused_k`` (the variable-length form)."""
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.name == "seqused_k" for a in schema.arguments)


def live_attention_supported(q: torch.Tensor) -> bool:
    """Whether :func:`live_slots_attention` runs flash attention for queries like ``q``: CUDA,
    fp16/bf16, a head size flash takes, sm_80 or newer, a torch with ``seqused_k``, and a
    once-per-process check on this device that the flash form equals the masked one."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    if torch.cuda.get_device_capability(q.device) < (8, 0) or not _flash_seqused_available():
        return False
    return _flash_form_checked(q.device.index if q.device.index is not None else torch.cuda.current_device(),
                               q.dtype, q.shape[-1])


@functools.lru_cache(maxsize=None)
def _flash_form_checked(device: int, dtype: torch.dtype, head_dim: int) -> bool:
    """Run the flash form once on small random inputs (three partitions, GQA, lengths inside
    the first, across partitions and the whole cache) against the masked softmax in float32; on
    an error or a mismatch, warn and let the drafter keep the masked form."""
    g = torch.Generator(device=f"cuda:{device}").manual_seed(0)
    q = torch.randn(3, 4, 4, head_dim, device=f"cuda:{device}", generator=g).to(dtype)
    k = torch.randn(3, 1536, 2, head_dim, device=f"cuda:{device}", generator=g).to(dtype)
    v = torch.randn(3, 1536, 2, head_dim, device=f"cuda:{device}", generator=g).to(dtype)
    used = torch.tensor([5, 700, 1536], device=f"cuda:{device}")
    scale = head_dim ** -0.5
    try:
        got = live_slots_attention(q, k, v, used, scale, partitions=3).float()
        mask = (torch.arange(1536, device=q.device) < used.unsqueeze(1))[:, None, None, :]
        want = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().repeat_interleave(2, 2).transpose(1, 2),
                                              v.float().repeat_interleave(2, 2).transpose(1, 2), attn_mask=mask,
                                              scale=scale).transpose(1, 2)
        err = ((got - want).norm() / want.norm()).item()
    except Exception as e:  # noqa: BLE001 -- any failure of the optional form means: keep the masked one
        warnings.warn(f"DFlash: flash attention over the live slots failed its check ({type(e).__name__}: {e}); "
                      "drafting with the masked attention over every cache slot", stacklevel=2)
        return False
    if not err < 2e-2:
        warnings.warn(f"DFlash: flash attention over the live slots differs from the masked form (relative "
                      f"error {err:.3g}); drafting with the masked attention over every cache slot", stacklevel=2)
        return False
    return True


def live_partitions(requests: int, heads: int, slots: int) -> int:
    """Static partitions per request: enough CTAs (requests x heads x P) to fill the GPU, each
    partition at least _PART_MIN_SLOTS slots."""
    want = -(-_PART_TARGET_CTAS // max(1, requests * heads))
    return max(1, min(want, slots // _PART_MIN_SLOTS))


def _flash_segments(q, k, v, cu_q, cu_k, max_q, max_k, used, scale):
    """flash attention's variable-length form: (out [Tq, H, D], lse [H, Tq] float32)."""
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False,
                                                       scale=scale, seqused_k=used)[:2]
    if lse.dim() == 3:  # older flash builds: padded [batch, H, max_q]
        lse = lse.permute(1, 0, 2).reshape(lse.shape[1], -1)
    return out, lse


def segments_reference(q, k, v, cu_q, cu_k, max_q, max_k, used, scale):
    """A torch form of :func:`_flash_segments` (for tests and any device): segment i's queries
    ``cu_q[i]:cu_q[i+1]`` attend keys ``cu_k[i]:cu_k[i] + used[i]`` (non-causal, GQA: query
    head h reads key head h // (H / Hkv)); an empty segment gives 0 and lse = +inf, as flash."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((heads, q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    for i in range(cu_q.numel() - 1):
        a, b, c, n = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(used[i])
        if n == 0 or a == b:
            continue
        kk = k[c:c + n].float().repeat_interleave(heads // kv_heads, dim=1)
        vv = v[c:c + n].float().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].float(), kk) * scale
        lse[:, a:b] = torch.logsumexp(s, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).to(q.dtype)
    return out, lse


def live_slots_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, used: torch.Tensor,
                         scale: float, *, partitions: int | None = None, segments=None) -> torch.Tensor:
    """Attention of q [R, t, H, D] over slots [0, used[r]) of cache_k / cache_v [R, S, Hkv, D]
    (non-causal; used int [R], 1 <= used <= S, read on the device only) -> [R, t, H, D].

    Request r's live slots [0, used[r]) are cut into P partitions of c_r = used[r] / P slots
    (rounded up to 16); each (request, partition) is one variable-length segment whose start and
    used length are computed on the device, so every context spreads its keys over the same P
    CTAs per head (a partition left empty by the rounding costs a CTA that exits at once).
    ``segments`` computes the segments (default: flash attention on CUDA,
    :func:`segments_reference` elsewhere, which reads the lengths on the host); the partitions
    merge by their log-sum-exp in float32."""
    r, t, heads, d = q.shape
    slots, kv_heads = cache_k.shape[1], cache_k.shape[2]
    parts = max(1, min(partitions or live_partitions(r, heads, slots), -(-slots // 16)))
    dev = q.device
    u = used.to(torch.int64).unsqueeze(1)                                                  # [R, 1]
    chunk = (u + parts - 1) // parts
    chunk = (chunk + 15) // 16 * 16                                                        # [R, 1]
    p0 = torch.arange(parts, device=dev) * chunk                                           # [R, P]
    seg_used = (u - p0).clamp(min=0).minimum(chunk)
    # segment i = (request i // P, partition i % P) starts at its request's row + min(p c_r, used):
    # starts move with the context, so they are device values like the lengths (aranges and
    # arithmetic only: no host-to-device copy, so a CUDA graph can capture it).  The trailing
    # entry, R * S, ends the packed rows; with seqused_k flash reads start + used only.
    starts = (torch.arange(r, device=dev).unsqueeze(1) * slots + p0.minimum(u)).flatten()
    cu_k = torch.cat([starts, starts.new_full((1,), r * slots)]).to(torch.int32)
    cu_q = (torch.arange(r * parts + 1, device=dev) * t).to(torch.int32)
    max_k = (-(-slots // parts) + 15) // 16 * 16                                             # the largest c_r
    qq = q.unsqueeze(1).expand(r, parts, t, heads, d).reshape(r * parts * t, heads, d)
    fn = segments or (_flash_segments if q.is_cuda else segments_reference)
    out, lse = fn(qq, cache_k.reshape(r * slots, kv_heads, d), cache_v.reshape(r * slots, kv_heads, d),
                  cu_q, cu_k, t, max_k, seg_used.flatten().to(torch.int32), scale)
    if parts == 1:
        return out.view(r, t, heads, d)
    live = (seg_used > 0).view(r, parts, 1, 1)
    lse = lse.view(heads, r, parts, t).permute(1, 2, 3, 0)                                  # [R, P, t, H]
    lse = torch.where(live, lse, float("-inf"))
    w = torch.exp(lse - lse.amax(1, keepdim=True))                                          # partition 0 is live
    o = torch.where(live.unsqueeze(-1), out.view(r, parts, t, heads, d).float(), 0.0)
    merged = (w.unsqueeze(-1) * o).sum(1) / w.sum(1).unsqueeze(-1)
    return merged.to(q.dtype)


class RowsLinear(nn.Linear):
    """An ``nn.Linear`` whose calls of a few rows (``gemm_rows_pays``: a draft block of one or two
    requests, an append of their accepted tokens) run ``kdtree::gemm_rows``, which streams the weight
    once through tensor cores where cuBLAS reads it at 0.3-0.5 of the bandwidth (bench/RESULTS.md
    run 178: the k2_slice drafter's fc, 103 MB, took 74.5 us); other calls are ``F.linear``.  A class
    swap on the drafter's own linears (:meth:`DFlashDraftModel.setup_cache`): state, hooks (a
    tensor-parallel rank's reductions) and checkpoints are the nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and gemm_rows_takes(self.weight, x):
            return gemm_rows(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def _project(modules, x: torch.Tensor) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``: linears that read the same x; bias-free RowsLinear ones without
    hooks go through the target's ``linears`` in the "rows" form, so those gemm_rows takes share one
    launch (q, k and v; gate and up)."""
    if all(type(m) is RowsLinear and m.bias is None and not (m._forward_hooks or m._forward_pre_hooks)
           for m in modules):
        return linears(modules, x, "rows")
    return [m(x) for m in modules]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, **factory):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False, **factory)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False, **factory)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False, **factory)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False, **factory)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, **factory)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, **factory)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, then RoPE) and raw values of x [R, T, H] -> [R, T, Hkv, D] each."""
        return self._key_value(*_project([self.k_proj, self.v_proj], x), cos, sin)

    def _key_value(self, k, v, cos, sin):
        r, t, _ = k.shape
        k = self.k_norm(k.view(r, t, self.num_kv_heads, self.head_dim))
        return _apply_rope(k, cos, sin), v.view(r, t, self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, cache_k, cache_v, layer, rows, slots, key_mask, used=None):
        """Block queries attend to every visible slot of layer ``layer``'s cache after the block's
        own K/V are written at ``slots``.  cache_k/v: every layer's [L, R, S, Hkv, D] (written with
        one index_put_ on the whole tensor: under torch.compile a write through the layer's view
        made inductor copy the layer's cache out and back in every step); key_mask bool [R, 1, 1, S]."""
        r, t, _ = x.shape
        q, k, v = _project([self.q_proj, self.k_proj, self.v_proj], x)
        q = _apply_rope(self.q_norm(q.view(r, t, self.num_heads, self.head_dim)), cos, sin)
        k, v = self._key_value(k, v, cos, sin)
        at = (torch.full_like(rows, layer), rows, slots)
        cache_k.index_put_(at, k)
        cache_v.index_put_(at, v)
        cache_k, cache_v = cache_k[layer], cache_v[layer]
        if used is not None:  # the live slots only (flash, CUDA): see live_slots_attention
            out = live_slots_attention(q, cache_k, cache_v, used, self.head_dim ** -0.5)
            return self.o_proj(out.reshape(r, t, self.num_heads * self.head_dim))
        # GQA without repeating K/V: the G query heads of one KV head become G*T query rows
        # (query head h reads KV head h // G); the mask depends on the key only, so it still fits.
        g = self.num_heads // self.num_kv_heads
        q = q.view(r, t, self.num_kv_heads, g, self.head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(r, self.num_kv_heads, g * t, self.head_dim)
        out = F.scaled_dot_product_attention(q, cache_k.transpose(1, 2), cache_v.transpose(1, 2),
                                             attn_mask=key_mask, scale=self.head_dim ** -0.5)
        out = out.view(r, self.num_kv_heads, g, t, self.head_dim).permute(0, 3, 1, 2, 4)
        return self.o_proj(out.reshape(r, t, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig, **factory):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        if i is None:
            raise ValueError("DFlash: intermediate_size is unknown; from_pretrained takes it from the checkpoint")
        self.gate_proj = nn.Linear(h, i, bias=False, **factory)
        self.up_proj = nn.Linear(h, i, bias=False, **factory)
        self.down_proj = nn.Linear(i, h, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _project([self.gate_proj, self.up_proj], x)
        return self.down_proj(F.silu(gate) * up)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, **factory):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = DFlashAttention(config, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = DFlashMLP(config, **factory)

    def forward(self, x, cos, sin, cache_k, cache_v, layer, rows, slots, key_mask, used=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_k, cache_v, layer, rows, slots, key_mask, used)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The DFlash drafter.  Parameter names are the public checkpoint's tensor names.

    Use: :meth:`bind_target` (the target's embedding and lm_head, borrowed, not owned),
    :meth:`setup_cache` (R requests, context capacity), then per step :meth:`append_context`
    with the taps of newly committed tokens and :meth:`forward` with the roots.
    """

    def __init__(self, config: DFlashConfig, *, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": dtype or config.torch_dtype or torch.float32}
        h = config.hidden_size
        self.fc = nn.Linear(config.num_taps * h, h, bias=False, **factory)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps, **factory)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, **factory) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, **factory)
        # Kept in float32 outside the buffers so that ``.to(bfloat16)`` cannot round it.
        self._inv_freq, self.rope_amplitude = rope_inv_freq(config)
        self._target = None
        # Attention over the live context slots only (live_slots_attention: flash attention's
        # variable-length form on CUDA) or the masked SDPA over every slot (the reference, and
        # the CPU's form).  None: the first where live_attention_supported, else the second.
        self.live_attention: bool | None = None
        self._live_auto = False
        # The linears of few rows through kdtree::gemm_rows (RowsLinear), or nn.Linear's cuBLAS.  None:
        # where the op has a kernel for the cache's device and the drafter computes in bf16.
        self.rows_gemm: bool | None = None
        self.context_capacity = 0
        self.register_buffer("context_k", None, persistent=False)
        self.register_buffer("context_v", None, persistent=False)
        self.register_buffer("context_lengths", None, persistent=False)

    # ---- properties of the drafter ----
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def live_attention_in_use(self) -> bool:
        """Whether draft calls attend over the live context slots only (``live_attention``, or
        where it is None, whether this device and dtype support it)."""
        if self.live_attention is not None:
            return bool(self.live_attention)
        return self._live_auto  # decided by setup_cache (eager: no device queries while compiling)

    # ---- borrowed target pieces ----
    def bind_target(self, embed_tokens, lm_head) -> "DFlashDraftModel":
        """Borrow the target's token embedding and output head (modules, or [V, H] weights).

        Neither becomes a submodule: they stay out of ``state_dict`` and ``parameters()``.
        A vocabulary-parallel head works as long as it maps [..., H] to logits; callers that do
        their own (sharded) top-K use ``forward(..., return_hidden=True)`` instead.
        """
        h = self.config.hidden_size
        for name, part in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            weight = part if isinstance(part, torch.Tensor) else getattr(part, "weight", None)
            if isinstance(part, (torch.Tensor, nn.Embedding, nn.Linear)) and weight.shape[-1] != h:
                raise ValueError(f"DFlash.bind_target: {name} has hidden size {weight.shape[-1]}, the drafter {h}")
        if isinstance(embed_tokens, (torch.Tensor, nn.Embedding)):
            rows = (embed_tokens if isinstance(embed_tokens, torch.Tensor) else embed_tokens.weight).shape[0]
            if self.mask_token_id >= rows:
                raise ValueError(f"DFlash.bind_target: mask_token_id {self.mask_token_id} is outside the "
                                 f"embedding's {rows} rows")
        self._target = (embed_tokens, lm_head)
        return self

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self._target[0]
        x = F.embedding(ids, embed) if isinstance(embed, torch.Tensor) else embed(ids)
        return x.to(self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's lm_head on the drafter's final hidden states."""
        if self._target is None:
            raise RuntimeError("DFlash: call bind_target(embed_tokens, lm_head) before drafting")
        head = self._target[1]
        return F.linear(hidden, head) if isinstance(head, torch.Tensor) else head(hidden)

    # ---- the static context cache ----
    def setup_cache(self, num_requests: int, capacity: int, *, device=None) -> None:
        """Allocate the context cache for ``num_requests`` requests of up to ``capacity`` context
        tokens each (zeroed: masked slots must hold finite values), all lengths 0."""
        if num_requests < 1 or capacity < 1:
            raise ValueError(f"DFlash.setup_cache: need num_requests >= 1 and capacity >= 1, "
                             f"got {num_requests}, {capacity}")
        c = self.config
        device = torch.device(device) if device is not None else self.device
        slots = -(-(capacity + c.block_size) // _SLOT_ALIGN) * _SLOT_ALIGN
        kv_heads = self.layers[0].self_attn.num_kv_heads if len(self.layers) else c.num_key_value_heads  # per rank
        shape = (c.num_hidden_layers, num_requests, slots, kv_heads, c.head_dim)
        self.context_k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.context_v = torch.zeros(shape, dtype=self.dtype, device=device)
        self.context_lengths = torch.zeros(num_requests, dtype=torch.int64, device=device)
        self.context_capacity = capacity
        self._live_auto = live_attention_supported(self.context_k[0, :1, :1].view(1, 1, kv_heads, c.head_dim))
        rows = self.rows_gemm
        if rows is None:
            rows = (device.type != "cpu" and self.dtype == torch.bfloat16
                    and torch._C._dispatch_has_kernel_for_dispatch_key("kdtree::gemm_rows", device.type.upper()))
        for m in self.modules():
            if type(m) in (nn.Linear, RowsLinear):
                m.__class__ = RowsLinear if rows else nn.Linear
        self._inv_freq = self._inv_freq.to(device)
        # Fixed addresses: a CUDA graph (cudagraph trees under mode="reduce-overhead") may then
        # mutate the cache in place instead of skipping graphs for "mutated inputs".
        for t in (self.context_k, self.context_v, self.context_lengths, self._inv_freq):
            torch._dynamo.mark_static_address(t)

    def reset_context(self, requests: torch.Tensor | None = None) -> None:
        """Empty the context of every request (``requests=None``) or of those where the bool
        [R] mask ``requests`` is true; on the device, no synchronisation."""
        self._require_cache("reset_context")
        if requests is None:
            self.context_lengths.zero_()
        else:
            self.context_lengths.masked_fill_(requests.to(self.context_lengths.device, torch.bool), 0)

    def _require_cache(self, op: str) -> None:
        if self.context_lengths is None:
            raise RuntimeError(f"DFlash.{op}: call setup_cache(num_requests, capacity) first")

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [R, T, D] for int64 positions [R, T]: angles in float32, scaled by the
        RoPE amplitude, then cast to the activation dtype (as transformers' Qwen3 does)."""
        inv_freq = self._inv_freq
        if inv_freq.device != positions.device:
            inv_freq = self._inv_freq = inv_freq.to(positions.device)
        angles = positions.float().unsqueeze(-1) * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * self.rope_amplitude).to(self.dtype), (emb.sin() * self.rope_amplitude).to(self.dtype)

    def append_context(self, taps: torch.Tensor, lengths: torch.Tensor | None = None, *,
                       valid: torch.Tensor | None = None, indices: torch.Tensor | None = None) -> None:
        """Append newly committed tokens' target taps to each request's context.

        Args:
            taps: [R, A, n*H_t], the outputs of target layers ``target_layer_ids`` concatenated
                tap-major, rows in position order.
            lengths: int [R]: rows ``[0, lengths[r])`` of request r are appended (the rest is
                ignored).  Or ``valid``: bool [R, A], the rows to append, in row order (e.g. a
                prompt's attention mask under left padding).  Neither: all A rows.
            indices: optional int [R, A'] row indices into ``taps`` gathered first, -1 = none
                (e.g. ``tree_accept``'s accepted node indices; without ``lengths``/``valid`` the
                rows with an index >= 0 are appended).  Pass ``indices[:, :block_size]``: no
                more nodes than that can be accepted, and fc then runs on block_size rows only.

        Appended row j of request r gets position ``context_lengths[r] + j``; lengths advance on
        the device.  Overflowing ``capacity`` raises in eager mode (value checks on); under
        compile / graph capture the overflow is clamped into the cache, never written outside.
        """
        self._require_cache("append_context")
        if indices is not None:
            gather = indices.long().clamp(min=0).unsqueeze(-1).expand(-1, -1, taps.shape[-1])
            taps = taps.gather(1, gather)
            if lengths is None and valid is None:
                valid = indices >= 0
        r, a, features = taps.shape
        n_req, slots = self.context_lengths.shape[0], self.context_k.shape[2]
        want = self.config.num_taps * self.config.hidden_size
        if r != n_req or features != want:
            raise ValueError(f"DFlash.append_context: taps must be [R={n_req}, A, {want}] (n_taps x hidden), "
                             f"got {tuple(taps.shape)}")
        device = taps.device
        rows_a = torch.arange(a, device=device)
        if valid is None:
            valid = (rows_a < lengths.to(device).unsqueeze(1)) if lengths is not None else \
                torch.ones(r, a, dtype=torch.bool, device=device)
        elif lengths is not None:
            raise ValueError("DFlash.append_context: pass lengths or valid, not both")
        if valid.shape != (r, a):
            raise ValueError(f"DFlash.append_context: valid must be [{r}, {a}], got {tuple(valid.shape)}")
        valid = valid.to(torch.bool)
        counts = valid.sum(1)
        if value_checks_active(self.context_lengths):
            if lengths is not None and ((lengths < 0) | (lengths > a)).any():
                raise ValueError(f"DFlash.append_context: lengths must lie in [0, {a}], got {lengths.tolist()}")
            new = self.context_lengths + counts
            if (new > self.context_capacity).any():
                raise ValueError(f"DFlash.append_context: context capacity {self.context_capacity} exceeded "
                                 f"(lengths after append {new.tolist()}); call setup_cache with a larger capacity")
        positions = self.context_lengths.unsqueeze(1) + valid.long().cumsum(1) - 1
        sink = slots - 1
        slot = torch.where(valid, positions.clamp(max=sink), sink)
        rows = torch.arange(r, device=device).unsqueeze(1).expand(r, a)
        ctx = self.hidden_norm(self.fc(taps.to(self.dtype)))
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, cos, sin)
            at = (torch.full_like(rows, i), rows, slot)  # the whole cache, not a layer's view (see DFlashAttention)
            self.context_k.index_put_(at, k)
            self.context_v.index_put_(at, v)
        self.context_lengths.copy_((self.context_lengths + counts).clamp(max=self.context_capacity))

    # ---- one draft call ----
    def forward(self, root_tokens: torch.Tensor, *, return_hidden: bool = False) -> torch.Tensor:
        """Draft one block per request.

        Args:
            root_tokens: int64 [R], the last emitted token of each request (block position 0,
                at position ``context_lengths[r]``).
            return_hidden: return the final hidden states [R, L, H] (after ``norm``) instead of
                logits, for callers that apply a (vocabulary-parallel) head and top-K themselves.

        Returns logits [R, L = block_size - 1, V]; row i - 1 is the marginal of depth i.
        The context cache is unchanged afterwards (the block's K/V sit past the lengths).
        """
        self._require_cache("forward")
        if self._target is None:
            raise RuntimeError("DFlash: call bind_target(embed_tokens, lm_head) before drafting")
        r, bs, slots = root_tokens.shape[0], self.block_size, self.context_k.shape[2]
        if root_tokens.dim() != 1 or r != self.context_lengths.shape[0]:
            raise ValueError(f"DFlash.forward: root_tokens must be [R={self.context_lengths.shape[0]}], "
                             f"got {tuple(root_tokens.shape)}")
        device = root_tokens.device
        masks = torch.full((r, bs - 1), self.mask_token_id, dtype=root_tokens.dtype, device=device)
        x = self._embed(torch.cat((root_tokens.unsqueeze(1), masks), dim=1))
        offsets = torch.arange(bs, device=device)
        positions = self.context_lengths.unsqueeze(1) + offsets
        slot = positions.clamp(max=slots - 1)
        rows = torch.arange(r, device=device).unsqueeze(1).expand(r, bs)
        live = self.live_attention_in_use()
        used = (self.context_lengths + bs).clamp(max=slots) if live else None
        visible = torch.arange(slots, device=device) < (self.context_lengths + bs).unsqueeze(1)
        key_mask = None if live else visible[:, None, None, :]
        cos, sin = self._rope(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.context_k, self.context_v, i, rows, slot, key_mask, used)
        hidden = self.norm(x[:, 1:])
        return hidden if return_hidden else self.compute_logits(hidden)

    # ---- checkpoints (public DFlash format, safetensors only) ----
    @staticmethod
    def expected_tensors(config: DFlashConfig) -> dict[str, torch.Size]:
        """Tensor name -> shape of a checkpoint for ``config`` (3 + 11 x layers tensors)."""
        with torch.device("meta"):
            model = DFlashDraftModel(config, dtype=torch.float32)
        return {name: t.shape for name, t in model.state_dict().items()}

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, config: DFlashConfig | None = None,
                        dtype: torch.dtype | None = None, device=None, device_mesh=None) -> "DFlashDraftModel":
        """Load a DFlash checkpoint directory (``config.json`` + ``model.safetensors``), strictly:
        missing, unexpected, mis-shaped or wrong-dtype tensors raise an error naming them, a
        truncated or corrupt file a ``CheckpointError`` naming the file.

        ``config`` replaces the file's config (e.g. to override ``rope_parameters
        ["attention_factor"]``); ``dtype`` casts after the checks (default: the file's dtype).
        ``device_mesh`` (1-D): this rank's tensor-parallel shard (models/parallel.py), reading only
        its slices of the sharded tensors, after checking the global shapes.
        """
        config = copy.deepcopy(config) if config is not None else DFlashConfig.from_pretrained(path)
        file = os.path.join(path, WEIGHTS_NAME)
        if not os.path.isfile(file):
            others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")))
            hint = f" (found {others}: pickle checkpoints are not loaded; convert to safetensors)" if others else ""
            raise FileNotFoundError(f"DFlash: no {WEIGHTS_NAME} in {path}{hint}")
        read_safetensors_header(file)  # a truncated or corrupt download raises CheckpointError naming the file
        with safe_open(file, framework="pt", device="cpu") as f:
            names = {name: name.removeprefix("model.") for name in f.keys()}  # some re-exports prefix "model."
            found = {}
            for name, key in names.items():
                if key in found:
                    raise ValueError(f"DFlash: {file} holds {key!r} twice (with and without the 'model.' prefix)")
                found[key] = f.get_slice(name)
            if config.intermediate_size is None:  # config.json without it: the MLP weights say it
                gate = found.get("layers.0.mlp.gate_proj.weight")
                if gate is None:
                    raise ValueError("DFlash: config.json has no intermediate_size and the checkpoint no "
                                     "layers.0.mlp.gate_proj.weight to take it from")
                config.intermediate_size = int(gate.get_shape()[0])
            expected = cls.expected_tensors(config)
            problems = [f"missing tensors: {sorted(set(expected) - set(found))}"] if set(expected) - set(found) else []
            if set(found) - set(expected):
                problems.append(f"unexpected tensors: {sorted(set(found) - set(expected))}")
            file_dtype = config.torch_dtype
            for key in sorted(set(found) & set(expected)):
                shape, dt = tuple(found[key].get_shape()), SAFETENSORS_DTYPES.get(found[key].get_dtype())
                if shape != tuple(expected[key]):
                    problems.append(f"{key}: shape {list(shape)}, expected {list(expected[key])}")
                file_dtype = file_dtype or dt
                if dt != file_dtype or not (dt is not None and dt.is_floating_point):
                    problems.append(f"{key}: dtype {found[key].get_dtype()}, expected {file_dtype} "
                                    f"(the config's dtype, one floating dtype for every tensor)")
            if problems:
                raise ValueError(f"DFlash: checkpoint {path} does not match its config: " + "; ".join(problems))
            with torch.device("meta"):
                model = cls(config, dtype=file_dtype)
            tp = None
            if device_mesh is not None:
                from ..parallel import parallelize

                tp = parallelize(model, device_mesh).tp
            state = {key: found[key][tp.index(key, tuple(expected[key]))] if tp is not None and key in tp.shard_dims
                     else f.get_tensor(name) for name, key in names.items()}
        model.load_state_dict(state, strict=True, assign=True)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        return model

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the public DFlash format."""
        os.makedirs(path, exist_ok=True)
        self.config.dtype = str(self.dtype).removeprefix("torch.")
        self.config.save_pretrained(path)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
