"""Training the K2-architecture target: the model's own reference forward, chosen by a plan.

The kdtree ops have no autograd (``moe_route``'s choice, ``int4_moe``, the decode kernels), so a
training pass runs a :class:`~torch_kdtree.models.kimi_k2.plan.PassPlan` whose layers all take
torch forms: the prefill's expanded attention, the router's logits as a linear, ``topk`` for the
choice (the weights stay differentiable through the sigmoid scores), and dense routed experts as
bf16 grouped GEMMs on CUDA or looped over the experts in use on the CPU (:func:`training_plan`,
:func:`expert_form`: the one switch).  The routed experts train
dense; QAT (quant.py) fake-quantises them at the end.  On CUDA the step runs under bf16 autocast
over fp32 weights, which also makes the router's logits a bf16 GEMM in training (inference keeps
fp32 logits); the routing bias stays fp32.

Load balance is DeepSeek-V3's auxiliary-loss-free rule: after every optimizer step each MoE
layer's ``e_score_correction_bias`` moves by ``speed`` toward balance, up for experts that
received fewer tokens than the mean in that step, down for those that received more.  The bias
only selects experts; the weights come from the unbiased scores.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

from torch_kdtree.models.kimi_k2 import KimiK2Config, KimiK2ForCausalLM
from torch_kdtree.models.kimi_k2.plan import PassPlan
from torch_kdtree.models.kimi_k2.writer import k2_config_dict

from .quant import expert_weights, fake_quantized
from .recipe import lr_at


def target_config(recipe, vocab_size: int) -> KimiK2Config:
    """The recipe's target as a K2 config (the K2 config.json fields, scaled down)."""
    return KimiK2Config.from_dict(k2_config_dict({**recipe.target, "vocab_size": vocab_size}, int4=False, small=False))


def build_target(recipe, vocab_size: int, seed: int, device) -> KimiK2ForCausalLM:
    """A freshly initialised fp32 target (transformers' init: normal(0, initializer_range), norms 1,
    routing bias 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = KimiK2ForCausalLM(target_config(recipe, vocab_size)).float()
    return model.to(device).train()


def moe_blocks(model) -> list:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


EXPERT_FORMS = ("auto", "grouped_padded", "looped", "gathered")


def expert_form(experts: str, device) -> str:
    """``"auto"``: ``"grouped_padded"`` on CUDA (bf16 grouped GEMMs, no host sync), ``"looped"``
    elsewhere (fp32 on the CPU, where ``grouped_mm`` computes in bf16 only); else ``experts``."""
    if experts not in EXPERT_FORMS:
        raise ValueError(f"training: experts must be one of {', '.join(EXPERT_FORMS)}, got {experts!r}")
    if experts == "auto":
        return "grouped_padded" if torch.device(device).type == "cuda" else "looped"
    return experts


def training_plan(model, R: int, T: int, experts: str = "looped") -> PassPlan:
    """The plan of a differentiable prefill of R x T tokens: every layer's reference forward
    (expanded attention, linear router logits, ``topk``) with the routed experts
    ``"grouped_padded"`` (models/kimi_k2/fused.py: three bf16 grouped GEMMs over rows sorted by
    expert, no host sync; the CUDA default), ``"looped"`` over the experts in use (one GEMM per
    expert, no weight copies; the CPU default, any dtype) or ``"gathered"`` per (token, slot), the
    experts' own forward (fixed shapes, but a weight copy per slot and a slow scatter in the
    backward); ``"auto"`` chooses by the model's device (:func:`expert_form`)."""
    experts = expert_form(experts, model.model.embed_tokens.weight.device)
    plan = model.model.plan_pass(R, T, tree=False).reference()
    return replace(plan, layers=tuple(replace(lp, experts=experts) if lp.experts else lp for lp in plan.layers))


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, counted from forward hooks on the norm that
    feeds the router (the choice recomputed from the same input, bias and dtype context)."""

    def __init__(self, model):
        self.blocks = moe_blocks(model)
        E = self.blocks[0].gate.weight.shape[0] if self.blocks else 0
        device = model.model.embed_tokens.weight.device
        self.step = torch.zeros(len(self.blocks), E, dtype=torch.int64, device=device)
        self.total = torch.zeros_like(self.step)
        self.handles = []
        layers = [layer for layer in model.model.layers if hasattr(layer.mlp, "experts")]
        for i, layer in enumerate(layers):
            self.handles.append(layer.post_attention_layernorm.register_forward_hook(self._hook(i)))

    def _hook(self, i: int) -> Callable:
        gate = self.blocks[i].gate

        def count(module, args, out):
            with torch.no_grad():
                ids, _ = gate.route(gate.logits(out.detach().reshape(-1, out.shape[-1])))
                flat = ids.reshape(-1).long()  # index_add_, not bincount: CUDA's bincount reads max() back
                self.step[i].index_add_(0, flat, torch.ones_like(flat))
        return count

    def take_step(self) -> torch.Tensor:
        """This step's counts [layers, E] (and add them to the total)."""
        counts = self.step.clone()
        self.total += counts
        self.step.zero_()
        return counts

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    @staticmethod
    def balance(counts: torch.Tensor) -> dict:
        """min / mean and max / mean load per layer, and the worst layer's min / mean."""
        counts = counts.float()
        mean = counts.mean(-1).clamp_min(1e-9)
        low, high = (counts.min(-1).values / mean), (counts.max(-1).values / mean)
        return {"min_over_mean": [round(float(x), 4) for x in low], "max_over_mean": [round(float(x), 4) for x in high],
                "worst_min_over_mean": float(low.min()) if low.numel() else float("nan")}


@torch.no_grad()
def update_routing_bias(model, counts: torch.Tensor, speed: float) -> None:
    """DeepSeek-V3's aux-free balancing: bias += speed * sign(mean load - load), per MoE layer."""
    for block, c in zip(moe_blocks(model), counts.float()):
        block.gate.e_score_correction_bias.add_(speed * torch.sign(c.mean() - c))


def optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; matrices decay, norms do not (the routing bias is a buffer, moved only by the balance rule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    fused = params[0].is_cuda
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def autocast(device) -> object:
    """bf16 autocast on CUDA (fp32 master weights and optimizer state); fp32 on the CPU."""
    device = torch.device(device)
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def next_token_loss(model, inputs, targets, plan) -> torch.Tensor:
    logits = model(inputs, plan=plan).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


PROFILE_STEPS = 3  # steps under the profiler when train(profile_step=...) asks for one


def profile_summary(prof, steps: int, seconds: float, device, top: int = 15) -> list[str]:
    """Where ``steps`` training steps of ``seconds`` (wall) went: on CUDA the kernels' own time
    per step against the wall time (a step whose kernels fill much less than its wall time is
    bound by the host: launches, syncs) and the kernels that took most of it; on the CPU the
    operators with the most self time."""
    events = prof.key_averages()
    per_step = seconds / steps
    if torch.device(device).type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
        launches = sum(e.count for e in kernels) / steps
        lines = [f"profile of {steps} steps: {per_step * 1e3:.1f} ms per step (wall), kernels {busy * 1e3:.1f} ms "
                 f"({busy / per_step:.0%} of it), {launches:.0f} kernel launches per step"]
        ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)
        lines += [f"  {e.self_device_time_total / 1e3 / steps:8.2f} ms  {e.count / steps:6.0f} x  "
                  f"{e.self_device_time_total / 1e6 / steps / max(busy, 1e-12):5.1%}  {e.key[:90]}" for e in ranked[:top]]
        return lines
    cpu = sum(e.self_cpu_time_total for e in events) / 1e6 / steps
    lines = [f"profile of {steps} steps: {per_step * 1e3:.1f} ms per step (wall), operators' self time "
             f"{cpu * 1e3:.1f} ms"]
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)
    lines += [f"  {e.self_cpu_time_total / 1e3 / steps:8.2f} ms  {e.count / steps:6.0f} x  {e.key[:90]}"
              for e in ranked[:top]]
    return lines


def read_back(pending: list[torch.Tensor], history: list[float], step: int, label: str) -> None:
    """Move the losses of the last ``len(pending)`` steps (the last one ``step``) from ``pending``
    (device tensors: reading them waits for the GPU, so the training loops do it at their progress
    lines only) to ``history``; a non-finite one raises ``FloatingPointError`` naming its step."""
    if not pending:
        return
    values = torch.stack(pending).float().tolist()
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise FloatingPointError(f"{label}: loss is {value} at step {step - len(values) + 1 + i}")
    history.extend(values)
    pending.clear()


def train(model, batches, *, steps: int, minutes: float, lr: float, warmup_steps: int, weight_decay: float,
          bias_update_speed: float, experts: str = "auto", qat: bool = False, log=print, log_every: int = 50,
          label: str = "target", call_minutes: float | None = None, resume: dict | None = None,
          profile_step: int | None = None) -> dict:
    """Train ``model`` on ``batches`` (an iterator of (inputs, targets) [R, T]) for ``steps`` or
    ``minutes``, whichever ends first (the learning rate follows the further of the two); with
    ``qat`` the routed experts are fake-quantised to INT4 in every forward and backward.

    A schedule may span several processes (a GPU lent in calls of ten minutes): ``call_minutes``
    stops this call early (after one step at least), and the next call passes the returned ``state`` as ``resume`` -- steps,
    tokens, seconds and losses so far, the optimizer's state and the expert load -- so the schedule
    goes on where it stopped.  ``profile_step``: the steps after this many of this call run under
    torch.profiler (:data:`PROFILE_STEPS` of them; their summary, :func:`profile_summary`, is
    logged).  Returns the loss history, the step count, tokens seen, the time, the expert load,
    ``finished`` (the schedule ran to its end) and that ``state``."""
    device = model.model.embed_tokens.weight.device
    opt = optimizer(model, lr, weight_decay)
    load = ExpertLoad(model)
    prior = resume or {}
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        load.total += resume["load_total"].to(load.total)
    quantised = expert_weights(model) if qat else []
    plan, shape = None, None
    history = list(prior.get("losses", []))
    # this call's losses not yet read back: reading one waits for the GPU, so they are read at each
    # progress line (and around the profiled steps) instead of after every step
    pending: list[torch.Tensor] = []
    step, tokens, before = prior.get("steps", 0), prior.get("tokens", 0), prior.get("seconds", 0.0)
    call_tokens, call_steps, start = 0, 0, time.perf_counter()
    prof, prof_start = None, 0.0
    window = torch.zeros_like(load.total)  # counts since the last progress line
    warmup = warmup_steps / max(steps, 1)
    finished = False
    try:
        while True:
            now = time.perf_counter() - start
            progress = max(step / steps, (before + now) / (60 * minutes))
            if progress >= 1:
                finished = True
                break
            if call_minutes is not None and call_tokens and now >= 60 * call_minutes:  # a call makes >= 1 step
                break
            if profile_step is not None and call_steps == profile_step:
                read_back(pending, history, step, label)  # the steps before the profiled ones have finished
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
                prof.__enter__()
                prof_start = time.perf_counter()
            inputs, targets = next(batches)
            if shape != tuple(inputs.shape):
                shape = tuple(inputs.shape)
                plan = training_plan(model, *shape, experts=experts)
            for group in opt.param_groups:
                group["lr"] = lr_at(progress, lr, warmup)
            with fake_quantized(quantised) if qat else nullcontext():
                with autocast(device):
                    loss = next_token_loss(model, inputs, targets, plan)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            counts = load.take_step()
            window += counts
            update_routing_bias(model, counts, bias_update_speed)
            step += 1
            call_steps += 1
            tokens += inputs.numel()
            call_tokens += inputs.numel()
            pending.append(loss.detach())
            if prof is not None and call_steps == profile_step + PROFILE_STEPS:
                read_back(pending, history, step, label)  # waits for the profiled steps' kernels
                wall = time.perf_counter() - prof_start
                prof.__exit__(None, None, None)
                for line in profile_summary(prof, PROFILE_STEPS, wall, device):
                    log(f"  {label} {line}")
                prof = None
            if step % log_every == 0 or step == 1:
                read_back(pending, history, step, label)
                now = time.perf_counter() - start
                recent = history[-log_every:]
                balance = ExpertLoad.balance(window)["worst_min_over_mean"]
                window.zero_()
                log(f"  {label} step {step:5d}  loss {sum(recent) / len(recent):.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                    f"load min/mean {balance:.2f}  {call_tokens / now:,.0f} tok/s  {before + now:6.1f} s")
        read_back(pending, history, step, label)  # and so the time below counts every step's kernels
    finally:
        load.remove()
        if prof is not None:  # the schedule ended inside the profiled steps
            prof.__exit__(None, None, None)
    now = time.perf_counter() - start
    seconds = before + now
    state = {"steps": step, "tokens": tokens, "seconds": seconds, "losses": history, "optimizer": opt.state_dict(),
             "load_total": load.total.clone(), "calls": prior.get("calls", 0) + 1}
    return {"steps": step, "tokens": tokens, "seconds": round(seconds, 2), "loss_first": history[0] if history else None,
            "loss_last": sum(history[-10:]) / max(1, len(history[-10:])), "losses": history,
            "tokens_per_second": call_tokens / max(now, 1e-9), "train_load": ExpertLoad.balance(load.total),
            "experts": plan.layers[-1].experts if plan is not None else expert_form(experts, device),
            "calls": state["calls"], "finished": finished, "state": state}


__all__ = ["target_config", "build_target", "training_plan", "expert_form", "EXPERT_FORMS", "ExpertLoad", "update_routing_bias", "train",
           "next_token_loss", "autocast", "moe_blocks", "profile_summary", "PROFILE_STEPS"]
