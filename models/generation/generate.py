"""``KimiK2ForCausalLM.generate``: transformers-style arguments in, DDTree or autoregressive
decoding through :class:`~.session.GenerationSession`, transformers-style output out.

    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=256, eos_token_id=eos,
                         speculative="ddtree", drafter=drafter, tree_budget="auto",
                         do_sample=True, temperature=0.7, top_p=0.9, streamer=streamer,
                         return_dict_in_generate=True)
    out.sequences          # [R, T + generated], prompts as given, pad_token_id after each end
    out.accept_lengths     # [R, steps] tokens each step emitted (0 once finished)

``speculative=None`` (and no drafter) is plain autoregressive decoding through the same paged
cache, kernels and CUDA graphs.  Greedy DDTree output equals greedy autoregressive output token
for token; sampled output has the autoregressive distribution (sample-and-walk, sampling.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.utils import ModelOutput

from .budget import AUTO_BUDGETS, BudgetPlanner, FixedBudget
from .sampling import SamplingMode
from .session import GenerationSession, size_bucket as _bucket

MAX_SESSIONS = 4  # sessions (buffers + graphs) kept per model, the least recently used dropped
# transformers' defaults for fields a GenerationConfig leaves unset (None)
_DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
# Fields whose non-neutral values this loop does not implement: refused by name, never ignored.
_NEUTRAL = {
    "num_beams": (None, 1),
    "encoder_repetition_penalty": (None, 1.0), "length_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "min_length": (None, 0),
    "top_h": (None,), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "sequence_bias": (None,), "guidance_scale": (None, 1.0), "stop_strings": (None,), "max_time": (None,),
    "output_scores": (None, False), "output_logits": (None, False), "output_attentions": (None, False),
    "output_hidden_states": (None, False), "penalty_alpha": (None,), "dola_layers": (None,),
    "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0), "constraints": (None,),
    "force_words_ids": (None,), "watermarking_config": (None,), "prompt_lookup_num_tokens": (None,),
    "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False),
}
_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_REFUSED_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
                 "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "assistant_tokenizer",
                 "tokenizer")


@dataclass
class DDTreeGenerateOutput(ModelOutput):
    """sequences [R, T + G]: prompts as given, then the generated tokens, ``pad_token_id`` after a
    request's end.  accept_lengths int [R, steps]: tokens each step emitted per request (0 once
    finished).  budgets: the tree budget of each step (0 = autoregressive).  profile: per-step
    phase times (ms) and accept lengths, with ``profile=True``, and ``plan``, the session's decode
    plan (which kernels each layer of each step ran, models/kimi_k2/plan.py).  budget_history: the planner's
    estimates per segment with ``tree_budget="auto"``.  step_seconds: time inside the decoding
    steps (CUDA events; no prefill, no host gaps, no oracle look-ahead).  prefill_seconds: the
    prompts' prefill through the first token (the time to first token on the device, CUDA events;
    the host's clock on the CPU); the rest of a call's wall time beyond the two is host work
    between segments, the reset and the output's assembly."""

    sequences: torch.LongTensor = None
    accept_lengths: Optional[torch.Tensor] = None
    budgets: Optional[list] = None
    profile: Optional[list] = None
    plan: Optional[str] = None
    budget_history: Optional[list] = None
    step_seconds: Optional[float] = None
    prefill_seconds: Optional[float] = None

    @property
    def mean_accept_length(self) -> float:
        """Mean tokens per step over the steps where a request was running."""
        running = self.accept_lengths[self.accept_lengths > 0]
        return float(running.float().mean()) if running.numel() else 0.0


def _resolve_config(model, generation_config, kwargs) -> GenerationConfig:
    for name in _REFUSED_ARGS:
        if kwargs.pop(name, None) is not None:
            raise NotImplementedError(f"generate: {name} is not supported by the DDTree / paged-cache loop")
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)
    if unused:
        raise TypeError(f"generate: unexpected arguments {sorted(unused)}")
    for name, neutral in _NEUTRAL.items():
        if getattr(config, name, None) not in neutral:
            raise NotImplementedError(f"generate: {name}={getattr(config, name)!r} is not supported "
                                      f"(supported: max_new_tokens, max_length, eos_token_id, pad_token_id, "
                                      f"min_new_tokens, repetition_penalty, do_sample, num_return_sequences, "
                                      f"temperature, top_k, top_p, min_p)")
    return config


def _check_input_ids(input_ids) -> torch.Tensor:
    """``input_ids`` as an integer [R, T] tensor (a 1-D prompt becomes one request)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"generate: input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in _TOKEN_DTYPES:
        raise ValueError(f"generate: input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"generate: input_ids must be [batch, tokens] (or [tokens]), got shape {tuple(input_ids.shape)}")
    return input_ids


def _check_vocabulary(prompts: torch.Tensor, vocab_size: int) -> None:
    """Every prompt token in [0, vocab_size); ``prompts`` is the host copy (padding holds 0)."""
    bad = (prompts < 0) | (prompts >= vocab_size)
    if bad.any():
        r, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"generate: input_ids holds token id {int(prompts[r, t])} (request {r}), outside the "
                         f"target's vocabulary [0, {vocab_size}); ids span [{int(prompts.min())}, {int(prompts.max())}]")


def _check_drafter(target, drafter) -> None:
    """The drafter embeds with the target's embedding, drafts through its lm_head and reads its
    layers' outputs: hidden size, vocabulary, taps, dtype and device must agree (an oracle's
    ``inner`` drafter too)."""
    inner = getattr(drafter, "inner", None)
    if inner is not None:
        _check_drafter(target, inner)
    config, tc = getattr(drafter, "config", None), target.config
    for field, theirs in (("hidden_size", tc.hidden_size), ("vocab_size", tc.vocab_size)):
        ours = getattr(config, field, None)
        if ours is not None and ours != theirs:
            raise ValueError(f"generate: the drafter's {field} {ours} != the target's {field} {theirs} "
                             f"(a drafter made for another target)")
    taps = list(getattr(drafter, "target_layer_ids", ()))
    if any(not 0 <= i < tc.num_hidden_layers for i in taps):
        raise ValueError(f"generate: the drafter's target_layer_ids {taps} are not all layers of the target "
                         f"(num_hidden_layers {tc.num_hidden_layers})")
    dtype, device = getattr(drafter, "dtype", None), getattr(drafter, "device", None)
    if isinstance(dtype, torch.dtype) and dtype != target.dtype:
        raise ValueError(f"generate: the drafter's dtype {dtype} != the target's dtype {target.dtype} "
                         f"(drafter.to({target.dtype}))")
    if isinstance(device, (torch.device, str)) and torch.device(device) != target.device:
        raise ValueError(f"generate: the drafter's device {device} != the target's device {target.device} "
                         f"(drafter.to('{target.device}'))")


def _value(config: GenerationConfig, name: str):
    value = getattr(config, name, None)
    return _DEFAULTS[name] if value is None else value


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompts (on the host) and their lengths from left- or right-padded ``input_ids`` [R, T]."""
    ids = input_ids.to("cpu")  # the one host copy: the mask's layout and the vocabulary are checked on it
    if attention_mask is None:
        return ids, torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64)
    mask = attention_mask.to("cpu").bool()
    if mask.shape != input_ids.shape:
        raise ValueError(f"generate: attention_mask shape {tuple(mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    lengths = mask.sum(1)
    if (lengths == 0).any():
        raise ValueError("generate: every request needs at least one prompt token (attention_mask row of zeros)")
    first = mask.long().argmax(1)
    t = torch.arange(mask.shape[1])
    if not torch.equal(mask, (t >= first[:, None]) & (t < (first + lengths)[:, None])):
        raise ValueError("generate: each attention_mask row must be one contiguous run of ones (left or right padding)")
    gather = (first[:, None] + t).clamp(max=mask.shape[1] - 1)
    right = torch.where(t < lengths[:, None], ids.gather(1, gather), torch.zeros_like(ids))
    return right, lengths


class DDTreeGenerationMixin(GenerationMixin):
    """``generate`` for :class:`KimiK2ForCausalLM`: DDTree speculative or autoregressive decoding
    in CUDA graphs over the paged latent cache (module docstring).  transformers' own loop stays
    reachable as ``GenerationMixin.generate(model, ...)``."""

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *,
                 attention_mask: torch.Tensor | None = None, speculative: str | None = None, drafter=None,
                 tree_budget: int | str = "auto", streamer=None, profile: bool = False, sync_every: int = 8,
                 cuda_graphs: bool = True, compile_step: bool | str | dict = "auto", page_size: int = 64,
                 kv_cache_dtype: str | torch.dtype = "auto", **kwargs):
        """Generate continuations of ``inputs`` [R, T] (or ``input_ids=``).

        Args:
            generation_config / kwargs: transformers' fields ``max_new_tokens`` (or
                ``max_length``), ``min_new_tokens``, ``repetition_penalty``, ``eos_token_id`` (int or list),
                ``pad_token_id``, ``do_sample``, ``num_return_sequences`` (sampling: each prompt's
                samples on consecutive rows, as transformers orders them),
                ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``return_dict_in_generate``; anything
                else that would change the output is refused by name.
            attention_mask: [R, T], one run of ones per row (left or right padding).
            speculative: ``"ddtree"`` (implied by a drafter) or None for autoregressive decoding.
            drafter: a DFlash drafter (``DFlashDraftModel``) or an :class:`OracleDrafter`.
            tree_budget: B, the number of draft nodes per tree (1..1024), or ``"auto"`` (budget.py).
            streamer: transformers' ``BaseStreamer`` (``put`` / ``end``), batch size 1; it receives
                the prompt, then new tokens every ``sync_every`` steps.
            profile: run steps eagerly with per-phase CUDA-event times (``out.profile``).
            sync_every: steps between the host's checks for finished requests (default 8).
            cuda_graphs: capture each step in a CUDA graph and replay it (CUDA only).
            compile_step: also run the step through ``torch.compile(fullgraph=True)``
                (True: inductor; ``"combo"`` / ``"tuned"``: inductor with session.INDUCTOR_OPTIONS;
                a backend name; or a dict of inductor options); inductor compiles add
                programmatic dependent launch on sm_90+ (session.inductor_options).  ``"auto"``
                (default): ``"combo"`` when the steps are CUDA graphs on a CUDA device (each
                budget's step compiles once per session, ~15 s), else eager.  ``"tuned"`` adds
                coordinate-descent tuning (~65-85 s of compile per budget the first time, cached
                on disk by inductor; on the 2p2b decode step it measured no faster than
                ``"combo"`` in run 31).
            page_size: tokens per page of the paged latent cache.
            kv_cache_dtype: the latent cache's storage, as vLLM / SGLang name it: ``"auto"`` (the
                model's dtype), ``"fp8"`` / ``"fp8_e4m3"`` (e4m3 with one fp32 scale per token and
                layer, docs/kimi_k2.md; tree and decode steps attend through mla_tree_attention
                where its kernel is, in torch ops elsewhere),
                or ``"bfloat16"`` / ``"float16"`` / ``"float32"``.
            prefill_chunk_size (a kwarg or GenerationConfig field, transformers' name): prompt
                tokens per prefill pass; longer prompts are prefilled chunk by chunk, each chunk
                attending to the cache and itself, with the same result and memory for one chunk
                (None, the default: 8192, ``modeling.PREFILL_CHUNK``; a 200k-token prompt just works).

        Returns ``sequences`` [R x num_return_sequences, T + G] (a LongTensor), or a :class:`DDTreeGenerateOutput`
        with ``return_dict_in_generate=True``.
        """
        from torch_kdtree.models.kimi_k2.cache import resolve_kv_cache_dtype
        from torch_kdtree.models.kimi_k2.modeling import prefill_chunk

        input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if input_ids is None:
            raise ValueError("generate: pass input_ids")
        try:
            kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        except (TypeError, ValueError) as e:
            raise type(e)(f"generate: {e}") from None
        input_ids = _check_input_ids(input_ids)
        config = _resolve_config(self, generation_config, kwargs)
        if speculative is None and drafter is not None:
            speculative = "ddtree"
        if speculative not in (None, "ddtree"):
            raise ValueError(f"generate: speculative must be 'ddtree' or None, got {speculative!r}")
        if speculative == "ddtree" and drafter is None:
            raise ValueError("generate: speculative='ddtree' needs a drafter (a DFlashDraftModel or OracleDrafter)")
        if speculative is not None:
            _check_drafter(self, drafter)
        n = config.num_return_sequences or 1
        if n > 1:  # transformers' rule and order: independent samples, each prompt's n rows together
            if not _value(config, "do_sample"):
                raise ValueError(f"generate: num_return_sequences = {n} needs do_sample=True (greedy decoding "
                                 f"returns one sequence per prompt; transformers refuses it the same way)")
            input_ids = input_ids.repeat_interleave(n, 0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(n, 0)
        R, T = input_ids.shape
        try:
            chunk = prefill_chunk(getattr(config, "prefill_chunk_size", None))
        except ValueError as e:
            raise ValueError(f"generate: {e}") from None
        max_new = config.max_new_tokens
        if max_new is None:
            max_new = _value(config, "max_length") - T
        if max_new < 0:
            raise ValueError(f"generate: max_length {config.max_length} is shorter than the prompt ({T} tokens)")
        eos = config.eos_token_id
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        return_dict = bool(config.return_dict_in_generate)
        if streamer is not None and R != 1:
            raise ValueError("generate: a streamer needs batch size 1 (as transformers' TextStreamer)")
        if max_new == 0:
            return DDTreeGenerateOutput(sequences=input_ids) if return_dict else input_ids
        prompts, lengths = _prompts(input_ids, attention_mask)
        _check_vocabulary(prompts, self.config.vocab_size)

        do_sample = bool(_value(config, "do_sample"))
        sampling = (_value(config, "temperature"), _value(config, "top_k"), _value(config, "top_p"),
                    getattr(config, "min_p", None)) if do_sample else None
        min_new = getattr(config, "min_new_tokens", None) or 0
        if isinstance(min_new, bool) or not isinstance(min_new, int) or min_new < 0:
            raise ValueError(f"generate: min_new_tokens must be an int >= 0, got {min_new!r}")
        penalty = getattr(config, "repetition_penalty", None)
        penalty = 1.0 if penalty is None else penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
            raise ValueError(f"generate: repetition_penalty must be a float > 0, got {penalty!r}")
        mode = SamplingMode(do_sample, do_sample and ((0 < sampling[1] < self.config.vocab_size) or sampling[2] < 1.0
                                                      or bool(sampling[3])), min_new=min_new > 0 and bool(eos),
                            penalty=penalty != 1.0)
        if speculative is None:
            budgets, auto = (0,), False
        elif tree_budget == "auto":
            budgets, auto = AUTO_BUDGETS, True
        elif isinstance(tree_budget, int) and not isinstance(tree_budget, bool) and 1 <= tree_budget <= 1024:
            budgets, auto = (tree_budget,), False
        else:
            raise ValueError(f"generate: tree_budget must be an int in [1, 1024] or 'auto', got {tree_budget!r}")

        if compile_step == "auto":  # inductor with combo kernels on CUDA graphs
            compile_step = "combo" if self.device.type == "cuda" and cuda_graphs and not profile else False
        session = _session(self, drafter if speculative else None, R=R, max_prompt=_bucket(T),
                           max_new=_bucket(max_new), budgets=budgets, mode=mode, page_size=page_size,
                           kv_cache_dtype=kv_dtype,
                           cuda_graphs=cuda_graphs and not profile, compile_step=compile_step, sync_every=sync_every,
                           measure=auto)
        policy = BudgetPlanner(budgets, session.step_seconds, tokens=max_new) if auto else FixedBudget(budgets[0])
        session.prefill(prompts, lengths, max_new=max_new, eos=eos, sampling=sampling, prefill_chunk_size=chunk,
                        min_new_tokens=min_new if mode.min_new else 0, repetition_penalty=float(penalty))
        if streamer is not None:
            streamer.put(prompts[:, : int(lengths[0])].cpu())
        sent = 0

        def stream():
            nonlocal sent
            tokens, count = session.tokens()
            if count[0] > sent:
                streamer.put(tokens[:, sent : count[0]])
                sent = count[0]

        run = session.run(policy, profile=profile, on_poll=stream if streamer is not None else None)
        if streamer is not None:
            streamer.end()

        generated, count = session.tokens()
        width = max(count)
        tail = torch.full((R, width), pad, dtype=torch.int64)
        for r, n in enumerate(count):
            tail[r, :n] = generated[r, :n]
        sequences = torch.cat([input_ids, tail.to(input_ids.device)], dim=1)
        if not return_dict:
            return sequences
        log = session.accept_log[: len(run["budgets"])].T.cpu()
        steps = int((log.sum(0) > 0).nonzero().max()) + 1 if log.any() else 0  # drop the idle tail
        return DDTreeGenerateOutput(sequences=sequences, accept_lengths=log[:, :steps],
                                    budgets=run["budgets"][:steps], profile=run["profile"][:steps] if profile else None,
                                    plan=str(session.plan) if profile else None,
                                    budget_history=getattr(policy, "history", None) if auto else None,
                                    step_seconds=run["step_seconds"], prefill_seconds=session.prefill_seconds())


def _session(model, drafter, *, R, max_prompt, max_new, budgets, mode, page_size, kv_cache_dtype, cuda_graphs,
             compile_step, sync_every, measure) -> GenerationSession:
    """A cached session of the model that fits these shapes (its graphs are reused), else a new one."""
    compiled = tuple(sorted(compile_step.items())) if isinstance(compile_step, dict) else compile_step  # hashable
    kind = (id(drafter), R, tuple(budgets), mode, page_size, kv_cache_dtype, cuda_graphs, compiled, sync_every,
            model.device, model.dtype)  # everything but the sizes
    key = (kind, max_prompt, max_new)
    sessions = model.__dict__.setdefault("_ddtree_sessions", {})
    if key not in sessions and (compile_step or (cuda_graphs and model.device.type == "cuda")):
        key = _larger_session(sessions, kind, max_prompt, max_new) or key
    session = sessions.pop(key, None)
    if session is not None and not session.drafter_is_current():
        session = None  # another session reallocated the drafter's context caches
    if session is None:
        while len(sessions) >= MAX_SESSIONS:
            sessions.pop(next(iter(sessions)))  # free the oldest buffers and graphs first
        session = GenerationSession(model, drafter, batch_size=R, max_prompt=max_prompt, max_new=max_new,
                                    budgets=budgets, mode=mode, page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                                    cuda_graphs=cuda_graphs, compile_step=compile_step, sync_every=sync_every)
        session.step_seconds = None
    elif drafter is not None and hasattr(drafter, "attach"):
        drafter.attach(model, session.cache)
    sessions[key] = session  # most recently used last
    if measure and session.step_seconds is None:  # measured once per drafter, batch size and budgets
        measured = model.__dict__.setdefault("_ddtree_step_seconds", {})
        timing_key = (id(drafter), R, tuple(budgets), mode, page_size, kv_cache_dtype, cuda_graphs, compiled)
        if timing_key not in measured:
            measured[timing_key] = session.measure_step_seconds(budgets)
        session.step_seconds = measured[timing_key]
    return session


def _larger_session(sessions: dict, kind: tuple, max_prompt: int, max_new: int):
    """The key of the smallest cached session that can serve a request of these sizes instead of
    a new one: the same ``kind`` (drafter, batch, budgets, modes, compilation), room for the
    prompt and the new tokens (``GenerationSession.prefill`` takes any prompt and output up to its
    sizes), at most
    twice the cache the request's own session would have (the plan's kernel choices follow the
    cache's capacity), and a drafter whose context caches are still its own.  Only for captured or
    compiled sessions, whose building costs a compilation per budget; an eager session is built
    for its exact sizes (cheap, and its arithmetic then never depends on an earlier call's)."""
    fits = [(s.max_prompt + s.max_new, k) for k, s in sessions.items()
            if k[0] == kind and s.max_prompt >= max_prompt and s.max_new >= max_new
            and s.max_prompt + s.max_new <= 2 * (max_prompt + max_new) and s.drafter_is_current()]
    return min(fits, key=lambda f: f[0], default=(0, None))[1]


__all__ = ["DDTreeGenerationMixin", "DDTreeGenerateOutput"]
