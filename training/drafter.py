"""Training the DFlash drafter on the INT4 target's own continuations (the published DFlash recipe).

Data: prompts from the training split, continued by the INT4 target (greedy, or sampled at
temperature 1), then one prefill of each whole sequence through the INT4 target for its taps —
the outputs of the drafter's ``target_layer_ids``.  A sequence's tokens after the prompt are the
target's own choices, so they are the labels.

One training step (DFlash, arXiv 2602.06036, as SpecForge implements it): per sequence, random
distinct anchors p; each anchor is one block ``[x_p, MASK x (bs - 1)]`` at positions p .. p + bs - 1
that attends, non-causally, to its own block and to the context ``hidden_norm(fc(taps))`` of
positions < p — exactly what a draft call sees after the target committed x_0 .. x_{p-1} and
x_p is the root.  Block position k predicts x_{p+k}; the cross-entropy there is weighted by
``exp(-(k - 1) / gamma)``, since a later depth counts only when all earlier ones were accepted.
All blocks of a batch run in one pass: :func:`block_logits` is the drafter's forward written for
many blocks at once with the modules of :class:`DFlashDraftModel` (tests pin it to the model's own
draft call).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from torch_kdtree.models.dflash import DFlashConfig, DFlashDraftModel
from torch_kdtree.models.dflash.modeling import _apply_rope

from .recipe import drafter_config_fields, lr_at
from .target import autocast, read_back


def build_drafter(recipe, vocab_size: int, mask_token_id: int, seed: int, device) -> DFlashDraftModel:
    """A freshly initialised fp32 drafter (PyTorch's Linear init, norms 1) for the recipe's target."""
    config = DFlashConfig(**drafter_config_fields(recipe, vocab_size, mask_token_id))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlashDraftModel(config, dtype=torch.float32)
    return drafter.to(device)


# --------------------------------------------------------------------------------------------
# data: continuations and taps
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def continuations(target, prompts: torch.Tensor, new_tokens: int, *, batch: int, greedy_fraction: float, seed: int,
                  log=print) -> torch.Tensor:
    """``prompts`` [N, P] continued by ``target`` for ``new_tokens`` (no end token): the first
    ``round(N * greedy_fraction)`` greedily, the rest sampled at temperature 1.  [N, P + new]."""
    n_greedy = round(prompts.shape[0] * greedy_fraction)
    out, start = [], time.perf_counter()
    torch.manual_seed(seed)
    for lo in range(0, prompts.shape[0], batch):
        chunk = prompts[lo: lo + batch].to(target.device)
        greedy = lo + chunk.shape[0] <= n_greedy
        split = max(0, min(chunk.shape[0], n_greedy - lo))
        parts = [(chunk[:split], True), (chunk[split:], False)] if not greedy and split else [(chunk, greedy)]
        for ids, is_greedy in parts:
            sampling = {} if is_greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
            seqs = target.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, compile_step=False, **sampling)
            out.append(seqs.cpu())
        log(f"  continuations {min(lo + batch, prompts.shape[0])}/{prompts.shape[0]}  "
            f"{time.perf_counter() - start:6.1f} s")
    return torch.cat(out)


@torch.no_grad()
def target_taps(target, seqs: torch.Tensor, layers: list[int], batch: int) -> torch.Tensor:
    """The target's taps of every position of ``seqs`` [N, S] (one causal prefill per sequence):
    [N, S, len(layers) * H] in the target's dtype, on its device."""
    out = []
    for lo in range(0, seqs.shape[0], batch):
        ids = seqs[lo: lo + batch].to(target.device)
        out.append(target(ids, tap_layers=layers, return_logits=False).taps)
    return torch.cat(out)


# --------------------------------------------------------------------------------------------
# the many-block forward and the loss
# --------------------------------------------------------------------------------------------

def sample_anchors(R: int, count: int, lo: int, hi: int, generator: torch.Generator) -> torch.Tensor:
    """[R, count] distinct anchors per row, uniform in [lo, hi] (count capped by the range)."""
    span = hi - lo + 1
    order = torch.rand(R, span, generator=generator).argsort(dim=1)[:, : min(count, span)]
    return order + lo


def block_logits(drafter: DFlashDraftModel, embed, lm_head, taps: torch.Tensor, ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Draft logits of every block: ``taps`` [R, S, n*H] of the sequences ``ids`` [R, S], blocks at
    ``anchors`` [R, N] -> [R, N, L = bs - 1, V], row k - 1 the marginal of x_{p + k}.

    The same math as a draft call of :class:`DFlashDraftModel` (context keys and values from
    ``hidden_norm(fc(taps))`` at their own positions, RoPE'd keys, non-causal attention over
    [context < p, own block]), for N blocks per sequence in one pass."""
    R, S = ids.shape
    N, bs = anchors.shape[1], drafter.block_size
    device = ids.device
    offsets = torch.arange(bs, device=device)
    block = torch.full((R, N, bs), drafter.mask_token_id, dtype=torch.long, device=device)
    block[:, :, 0] = ids.gather(1, anchors)
    x = embed(block.view(R, N * bs)).to(drafter.dtype)
    block_pos = (anchors[:, :, None] + offsets).view(R, N * bs)
    ctx_pos = torch.arange(S, device=device).expand(R, S)
    cos_b, sin_b = drafter._rope(block_pos)
    cos_c, sin_c = drafter._rope(ctx_pos)
    ctx = drafter.hidden_norm(drafter.fc(taps.to(drafter.dtype)))
    # [R, 1, N*bs, S + N*bs]: context strictly before the block's anchor, and the block itself
    sees_ctx = torch.arange(S, device=device)[None, None, :] < anchors.repeat_interleave(bs, 1)[:, :, None]
    own = torch.arange(N, device=device).repeat_interleave(bs)
    mask = torch.cat([sees_ctx, (own[:, None] == own[None, :]).expand(R, -1, -1)], dim=-1)[:, None]
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).view(R, N * bs, attn.num_heads, attn.head_dim))
        q = _apply_rope(q, cos_b, sin_b)
        kb, vb = attn.key_value(h, cos_b, sin_b)
        kc, vc = attn.key_value(ctx, cos_c, sin_c)
        k, v = torch.cat([kc, kb], 1), torch.cat([vc, vb], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=attn.head_dim ** -0.5, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(R, N * bs, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = drafter.norm(x.view(R, N, bs, -1)[:, :, 1:])
    return lm_head(hidden)


def block_labels(ids: torch.Tensor, anchors: torch.Tensor, depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [R, N, L] = x_{p + k}, valid [R, N, L]: p + k inside the sequence)."""
    S = ids.shape[1]
    at = anchors[:, :, None] + torch.arange(1, depths + 1, device=ids.device)
    valid = at < S
    labels = ids.gather(1, at.clamp(max=S - 1).view(ids.shape[0], -1)).view(at.shape)
    return labels, valid


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Cross-entropy weighted by depth, ``exp(-(k - 1) / gamma)``, averaged over the weights."""
    L = logits.shape[2]
    decay = torch.exp(-torch.arange(L, device=logits.device, dtype=torch.float32) / gamma)
    weights = valid.float() * decay
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce.view_as(weights) * weights).sum() / weights.sum().clamp_min(1e-6)


# --------------------------------------------------------------------------------------------
# training and held-out agreement
# --------------------------------------------------------------------------------------------

DRAW_CHUNK = 64  # training steps whose rows and anchors are drawn and moved to the device at once


def train_drafter(drafter, target, taps: torch.Tensor, seqs: torch.Tensor, recipe, *, seed: int, log=print) -> dict:
    """Train ``drafter`` on sequences ``seqs`` [M, S] with the target's taps [M, S, n*H]; anchors
    from the first generated token on (the first root a generation has) to S - 2."""
    device = drafter.device
    embed, head = target.model.embed_tokens, target.lm_head
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=recipe.drafter_lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    g = torch.Generator().manual_seed(seed)
    lo, hi = recipe.prompt_len, seqs.shape[1] - 2
    history, step, start = [], 0, time.perf_counter()
    warmup = min(0.1, 50 / max(recipe.drafter_steps, 1))
    # Nothing in a step waits for the GPU: the sequences live on the device, the rows and anchors of
    # DRAW_CHUNK steps are drawn on the CPU and moved together (a pageable copy waits for the queue),
    # and the losses are read back at the progress lines.
    seqs_dev = seqs.to(device)
    draws: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending: list[torch.Tensor] = []
    while True:
        progress = max(step / recipe.drafter_steps, (time.perf_counter() - start) / (60 * recipe.drafter_minutes))
        if progress >= 1:
            break
        if not draws:
            B = recipe.drafter_batch
            rows = torch.randint(0, seqs.shape[0], (DRAW_CHUNK, B), generator=g)
            anchors = sample_anchors(DRAW_CHUNK * B, recipe.anchors, lo, hi, g).view(DRAW_CHUNK, B, -1)
            draws = list(zip(rows.to(device).unbind(0), anchors.to(device).unbind(0)))[::-1]
        rows, anchors = draws.pop()
        ids = seqs_dev[rows]
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, recipe.drafter_lr, warmup)
        with autocast(device):
            logits = block_logits(drafter, embed, head, taps[rows.to(taps.device)].to(device), ids, anchors)
        labels, valid = block_labels(ids, anchors, logits.shape[2])
        loss = dflash_loss(logits, labels, valid, recipe.loss_decay_gamma)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        pending.append(loss.detach())
        if step % recipe.log_every == 0 or step == 1:
            read_back(pending, history, step, "drafter")
            with torch.no_grad():
                top1 = (logits[:, :, 0].argmax(-1) == labels[:, :, 0]).float().mean()
            recent = history[-recipe.log_every:]
            log(f"  drafter step {step:5d}  loss {sum(recent) / len(recent):.4f}  depth-1 acc {float(top1):.3f}  "
                f"{time.perf_counter() - start:6.1f} s")
    read_back(pending, history, step, "drafter")
    return {"steps": step, "seconds": round(time.perf_counter() - start, 2), "loss_first": history[0] if history else None,
            "loss_last": sum(history[-10:]) / max(1, len(history[-10:])), "losses": history}


@torch.no_grad()
def agreement(drafter, target, taps: torch.Tensor, seqs: torch.Tensor, prompt_len: int, batch: int) -> dict:
    """On held-out greedy continuations: how often the drafter's argmax at depth k equals the
    target's greedy token x_{p + k}, over every root p a generation has (the generated tokens), and the
    teacher-forced chain acceptance (1 + leading depths right, anchors with a full block only),
    which is a greedy chain's mean acceptance length when arithmetic is exact."""
    embed, head = target.model.embed_tokens, target.lm_head
    L = drafter.block_size - 1
    S = seqs.shape[1]
    right = torch.zeros(L, dtype=torch.float64)
    seen = torch.zeros(L, dtype=torch.float64)
    chains = []
    for lo in range(0, seqs.shape[0], batch):
        ids = seqs[lo: lo + batch].to(drafter.device)
        R = ids.shape[0]
        anchors = torch.arange(prompt_len, S - 1, device=ids.device).expand(R, -1)
        with autocast(drafter.device):
            logits = block_logits(drafter, embed, head, taps[lo: lo + batch].to(drafter.device), ids, anchors)
        labels, valid = block_labels(ids, anchors, L)
        hit = (logits.argmax(-1) == labels) & valid
        right += hit.sum((0, 1)).double().cpu()
        seen += valid.sum((0, 1)).double().cpu()
        full = valid.all(-1)
        chains.append((1 + hit.long().cumprod(-1).sum(-1))[full].cpu())
    per_depth = (right / seen.clamp_min(1)).tolist()
    chain = torch.cat(chains).double()
    return {"depth1_agreement": per_depth[0], "per_depth_agreement": [round(x, 4) for x in per_depth],
            "chain_acceptance_teacher_forced": float(chain.mean()) if chain.numel() else float("nan"),
            "anchors": int(seen[0])}


__all__ = ["build_drafter", "continuations", "target_taps", "sample_anchors", "block_logits", "block_labels",
           "dflash_loss", "train_drafter", "agreement"]
