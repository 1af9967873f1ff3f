"""The fused forms a :class:`~.plan.PassPlan` selects, run from outside the modules.

The modules in modeling.py and moe.py hold the reference forwards (torch ops; INT4 experts through
``kdtree::int4_moe``, their only implementation).  :func:`layer_forward` runs one decoder layer as
its :class:`~.plan.LayerPlan` says: the ``kdtree`` decode kernels with their fused prologues
(RMSNorm) and epilogues (SwiGLU, the residual add), the MLA kernels, the MoE kernels, or the
multiply + sum forms inductor turns into single reduction kernels.  Every choice was made by the
plan; nothing here looks at devices, dtypes, hooks or the environment.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from torch_kdtree.ops import gemv as fused_gemv
from torch_kdtree.ops import int4_moe, mla_decode, mla_prepare, mla_tree_attention, mla_tree_attention_output
from torch_kdtree.ops import moe_gemv, moe_route

from .gemv import linear, linears, matvec, products_as_matvec
from .moe import rank_topk
from .plan import LayerPlan

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

def _projections(attn, x, norm, mv):
    """q [R, T, h * (dn + dr)] and ckv [R, T, dc + dr].  With ``norm``, x is the residual stream
    and the norm runs inside the kdtree::gemv launch of the projections that read it."""
    if norm is not None:
        first = attn.q_proj if hasattr(attn, "q_proj") else attn.q_a_proj
        q, ckv = fused_gemv(x, [first.weight, attn.kv_a_proj_with_mqa.weight], norm.weight, norm.eps)
        if not hasattr(attn, "q_proj"):
            (q,) = fused_gemv(q, [attn.q_b_proj.weight], attn.q_a_layernorm.weight, attn.q_a_layernorm.eps)
        return q, ckv
    first = attn.q_proj if hasattr(attn, "q_proj") else attn.q_a_proj
    q, ckv = linears([first, attn.kv_a_proj_with_mqa], x, mv)
    if not hasattr(attn, "q_proj"):
        q = linear(attn.q_b_proj, attn.q_a_layernorm(q), mv)
    return q, ckv


def _o_proj(attn, out, residual, mv):
    """o_proj of the heads' values [R, N, h * dv] (plus ``residual`` inside kdtree::gemv's kernel)."""
    if residual is not None:
        return fused_gemv(out, [attn.o_proj.weight], residual=residual)[0]
    return linear(attn.o_proj, out, mv)


def attention(attn, lp: LayerPlan, x, cos, sin, batch, layer_idx: int, norm=None, add_residual: bool = True):
    """The attention of a tree pass as ``lp`` says.  With ``norm`` (``lp.qkv == "gemv_norm"``) x is
    the residual stream and the result is ``x + attention(norm(x))`` (``attention(norm(x))`` without
    ``add_residual``: tensor parallelism adds it after the reduction)."""
    mv = lp.linear_form
    q, ckv = _projections(attn, x, norm, mv)
    residual = x if norm is not None and add_residual else None
    R, N = x.shape[:2]
    cache = batch.cache
    heads = attn.kv_b_proj.weight.shape[0] // (attn.qk_nope_head_dim + attn.v_head_dim)
    if lp.attention == "torch":
        out = attn.tree_attention(*attn._rotate(x, q, ckv, cos, sin), batch, layer_idx)
        return _o_proj(attn, out, residual, mv)
    if lp.attention == "decode":  # RoPE, the norm, the cache write, W_UK, attention and W_UV in one launch
        out = mla_decode(q.reshape(R, heads, -1), ckv.reshape(R, -1), cos.reshape(R, -1), sin.reshape(R, -1),
                         attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, attn.kv_b_proj.weight, cache.kv,
                         layer_idx, batch.slots.reshape(R), cache.block_table, cache.lengths, attn.softmax_scale,
                         attn.rope_interleave, prefix_ready=True)
        return _o_proj(attn, out.to(x.dtype).reshape(R, N, -1), residual, mv)
    w_uk, w_uv = attn._kv_b()
    if lp.attention in ("prepare", "prepare_output"):
        M = R * N
        q = mla_prepare(q.reshape(M, heads, -1), ckv.reshape(M, -1), cos.reshape(M, -1), sin.reshape(M, -1),
                        attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, attn.kv_b_proj.weight, cache.kv,
                        layer_idx, batch.slots.reshape(M), attn.rope_interleave).view(R, N, heads, -1)
    else:  # "tree_op"
        q_nope, q_rope, latent = attn._rotate(x, q, ckv, cos, sin)
        cache.write(layer_idx, batch.slots, latent)
        if products_as_matvec(mv, w_uk):  # a reduction kernel fused with its neighbours (no batched GEMM)
            q_abs = (q_nope.float()[..., :, None] * w_uk.float()).sum(-2).to(x.dtype)
        else:
            q_abs = torch.einsum("rnhd,hdc->rnhc", q_nope, w_uk)
        # the kernel's query dtype: the cache rows' (bf16 / fp32), or over fp8 rows the compute dtype
        # reads dequantise to (the plan takes tree_op over fp8 only where the kernel takes it)
        q = torch.cat([q_abs, q_rope], dim=-1).to(cache.dtype if cache.quantized else cache.kv.dtype)
    # prefix_ready: the kernels just before this one write only q and the new tokens' rows; the
    # lengths, block table and committed rows date from earlier steps.
    if lp.attention == "prepare_output":  # the attention and W_UV in one op (its merge kernel)
        out = mla_tree_attention_output(q, cache.layer(layer_idx), cache.block_table, cache.lengths, batch.visible,
                                        attn.softmax_scale, attn.kv_b_proj.weight, attn.qk_nope_head_dim,
                                        prefix_ready=True).to(x.dtype)
        return _o_proj(attn, out.reshape(R, N, -1), residual, mv)
    o_lat = mla_tree_attention(q, cache.layer(layer_idx), cache.block_table, cache.lengths, batch.visible,
                               attn.softmax_scale, prefix_ready=True,
                               kv_scale=cache.kv_scale[layer_idx] if cache.quantized else None)
    if products_as_matvec(mv, w_uv):
        out = (o_lat.float()[..., None, :] * w_uv.float()).sum(-1).to(x.dtype)
    else:
        out = torch.einsum("rnhc,hdc->rnhd", o_lat.to(x.dtype), w_uv)
    return _o_proj(attn, out.reshape(R, N, -1), residual, mv)


# --------------------------------------------------------------------------------------------
# feed-forward
# --------------------------------------------------------------------------------------------

def mlp(module, x, mv):
    """``down(silu(gate(x)) * up(x))`` with the linears in form ``mv`` (a LayerPlan's ``linear_form``)."""
    gate, up = linears([module.gate_proj, module.up_proj], x, mv)
    return linear(module.down_proj, F.silu(gate) * up, mv)


def mlp_gemv_norm(module, h, norm, add_residual: bool = True):
    """``h + MLP(norm(h))`` in two kdtree::gemv launches (the norm inside gate/up's, SwiGLU and the
    residual add inside down's; ``MLP(norm(h))`` without ``add_residual``)."""
    g, u = fused_gemv(h, [module.gate_proj.weight, module.up_proj.weight], norm.weight, norm.eps)
    return fused_gemv(g, [module.down_proj.weight], up=u, residual=h if add_residual else None)[0]


def route(gate, logits, how: str):
    """(topk_ids int32 [T, k], topk_weights fp32 [T, k]) from the router's fp32 logits."""
    if how == "moe_route":
        return moe_route(logits, gate.e_score_correction_bias.float(), gate.top_k, gate.n_group, gate.topk_group,
                         bool(gate.norm_topk_prob), float(gate.routed_scaling_factor))
    return gate.route(logits, topk=rank_topk if how == "rank_topk" else None)


def router_logits(gate, x, how: str):
    if how == "matvec":
        return matvec(x, gate.weight)
    if how == "mm":  # tensor cores, fp32 accumulation of the exact 16-bit products
        return torch.mm(x, gate.weight.t(), out_dtype=torch.float32)
    return gate.logits(x)


def experts(module, how: str, x, topk_ids, topk_weights):
    if how == "moe_gemv":
        return moe_gemv(x, module.gate_proj, module.up_proj, module.down_proj, topk_ids, topk_weights)
    if how == "row_gemv":
        return _row_gemv(module, x, topk_ids, topk_weights)
    if how == "grouped_mm":
        return _grouped(module, x, topk_ids, topk_weights)
    if how == "looped":
        return module.looped(x, topk_ids, topk_weights)
    if how == "grouped_padded":
        return grouped_padded(module, x, topk_ids, topk_weights)
    return module(x, topk_ids, topk_weights)  # the reference: int4_moe, or the gathered weights


def moe(block, lp: LayerPlan, h, norm, reduce=None, residual_here: bool = True):
    """``h + MoE(norm(h))`` as ``lp`` says (``reduce``: tensor parallelism's all-reduce of the
    block's partial output).  Under ``reduce``, the fused launches (shared expert fused) add the
    residual on one rank only, ``residual_here`` (the first), and the all-reduce sums it in: at world
    1 the very launches of one device; the other forms add it after the reduction."""
    shape = h.shape
    h2 = h.reshape(-1, shape[-1])
    gate, shared = block.gate, block.shared_experts
    if lp.router == "gemv_norm":  # the norm as the prologue of the router's launch, returned
        logits, x = fused_gemv(h2, [gate.weight], norm.weight, norm.eps, fp32_outputs=1, return_input=True)
    else:
        x = norm(h2)
        if lp.router == "module":  # hooked: the block's own forward, as a module (its hooks reduce)
            return h + block(x.view(shape))
        logits = router_logits(gate, x, lp.router)
    topk_ids, topk_weights = route(gate, logits, lp.route)
    if lp.shared == "fused":  # the shared expert (and the residual) inside the experts' two launches
        sw = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
        res = h2 if reduce is None or residual_here else None
        if lp.experts == "int4_moe":
            y = int4_moe(x, block.experts.int4_weights(), topk_ids, topk_weights, shared=sw, residual=res)
        else:
            e = block.experts
            y = moe_gemv(x, e.gate_proj, e.up_proj, e.down_proj, topk_ids, topk_weights, *sw, res,
                         route_logits=logits if lp.route_hint else None)
        return y.view(shape) if reduce is None else reduce(y.view(shape))  # the first rank's y holds h
    y = experts(block.experts, lp.experts, x, topk_ids, topk_weights)
    if shared is not None:
        y = y + mlp(shared, x, lp.linear_form)
    y = y.view(shape)
    return h + (y if reduce is None else reduce(y))


def _grouped(module, x, topk_ids, topk_weights):
    """Rows sorted by expert, one ``grouped_mm`` per projection (fixed shapes, no host sync)."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(module.gate_proj.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    rows = x[order // k]
    h = F.silu(_grouped_mm(rows, module.gate_proj.transpose(1, 2), offs=offs)) * \
        _grouped_mm(rows, module.up_proj.transpose(1, 2), offs=offs)
    y_sorted = _grouped_mm(h, module.down_proj.transpose(1, 2), offs=offs)
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return (y.view(T, k, -1).float() * topk_weights[..., None]).sum(1).to(x.dtype)


GROUP_ALIGN = 8  # rows: each expert's group of a grouped_padded buffer starts at a multiple of this


def grouped_padded(module, x, topk_ids, topk_weights):
    """The dense routed experts for training: differentiable, no host sync, three bf16
    ``grouped_mm`` launches forward (``looped``'s loop costs a host sync and three GEMMs per expert in
    use, and as many GEMMs again backward).  The (token, slot) rows are sorted by expert into a buffer
    of static size in which every expert's group starts at a multiple of ``GROUP_ALIGN`` rows (the
    backward's weight gradients take the groups as the reduced dimension of a GEMM, whose operands
    stay 16-byte aligned so) and the last group runs to the buffer's end (rows past the last offset
    are left unwritten, their gradients too); padding rows gather a zero row.  The GEMMs run in
    bf16, the dtype ``grouped_mm`` computes in on the GPU; the slots are weighted in fp32, as
    ``looped`` does, and the result has x's dtype."""
    T, k = topk_ids.shape
    E, _, H = module.gate_proj.shape
    n = T * k
    size = -(-(n + E * (GROUP_ALIGN - 1)) // GROUP_ALIGN) * GROUP_ALIGN
    dev = x.device
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    e_sorted = flat[order]
    # buffer row of the i-th sorted slot: its expert's group start + its rank within the expert
    row_sorted = (padded.cumsum(0) - padded)[e_sorted] + torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[e_sorted]
    row = torch.empty_like(row_sorted).scatter_(0, order, row_sorted)  # buffer row of slot j (token j // k)
    src = torch.full((size,), T, dtype=torch.long, device=dev).scatter_(0, row, torch.arange(n, device=dev) // k)
    offs = padded.cumsum(0).to(torch.int32)
    offs[-1] = size
    bf = torch.bfloat16
    rows = torch.cat([x, x.new_zeros(1, H)])[src].to(bf)  # gathered in x's dtype: the backward sums k slots there
    gate = _grouped_mm(rows, module.gate_proj.to(bf).transpose(1, 2), offs=offs)
    up = _grouped_mm(rows, module.up_proj.to(bf).transpose(1, 2), offs=offs)
    y = _grouped_mm(F.silu(gate) * up, module.down_proj.to(bf).transpose(1, 2), offs=offs)
    return (y[row].view(T, k, H).float() * topk_weights[..., None]).sum(1).to(x.dtype)


def _row_gemv(module, x, topk_ids, topk_weights):
    """``W[ids] @ x`` per (token, slot) as a product and a sum, which inductor fuses into reduction
    kernels with indirect weight loads (no gathered copy, no sort).  fp32 accumulation; gate/up and
    the expert outputs are rounded to x's dtype where the GEMM path rounds them."""
    ids = topk_ids.long()
    xf = x.float()[:, None, None, :]
    gate = (xf * module.gate_proj[ids].float()).sum(-1).to(x.dtype)  # [T, k, I]
    up = (xf * module.up_proj[ids].float()).sum(-1).to(x.dtype)
    h = (F.silu(gate) * up).float()[:, :, None, :]
    y = (h * module.down_proj[ids].float()).sum(-1).to(x.dtype)  # [T, k, H]
    return (y.float() * topk_weights[..., None]).sum(1).to(x.dtype)


# --------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------

def layer_forward(layer, lp: LayerPlan, h, cos, sin, batch, layer_idx: int, reduce=None,
                  first_rank: bool = True) -> torch.Tensor:
    """One decoder layer as ``lp`` says (the same function as ``layer(h, ...)``).  ``reduce``
    (tensor parallelism, ``lp.reduce``): the all-reduce the modules' hooks apply to the attention
    and MLP outputs, applied here where the fused forms bypass the module calls.  A fused launch
    whose epilogue adds the residual does so on the first rank only (``first_rank``) and the
    all-reduce sums it in, so at world 1 the layer runs one device's launches, bit for bit."""
    attn = layer.self_attn
    if reduce is None:
        reduce = _same
    if lp.attention == "expanded":  # prefill: the reference attention (a module call: its hooks reduce)
        h = h + attn(layer.input_layernorm(h), cos, sin, batch, layer_idx)
    elif lp.qkv == "gemv_norm" and not lp.reduce:  # the residual inside o_proj's launch
        h = attention(attn, lp, h, cos, sin, batch, layer_idx, norm=layer.input_layernorm)
    elif lp.qkv == "gemv_norm":
        h = reduce(attention(attn, lp, h, cos, sin, batch, layer_idx, norm=layer.input_layernorm,
                             add_residual=first_rank))
    else:
        h = h + reduce(attention(attn, lp, layer.input_layernorm(h), cos, sin, batch, layer_idx))
    if lp.experts:
        return moe(layer.mlp, lp, h, layer.post_attention_layernorm, reduce if lp.reduce else None, first_rank)
    if lp.mlp == "gemv_norm":
        if not lp.reduce:
            return mlp_gemv_norm(layer.mlp, h, layer.post_attention_layernorm)
        return reduce(mlp_gemv_norm(layer.mlp, h, layer.post_attention_layernorm, add_residual=first_rank))
    return h + reduce(mlp(layer.mlp, layer.post_attention_layernorm(h), lp.linear_form))


def _same(x):
    return x


__all__ = ["layer_forward", "attention", "moe", "mlp", "experts", "route"]
