"""The device-resident generation loop: prefill, the DDTree / autoregressive step, CUDA graphs.

A :class:`GenerationSession` owns every buffer one batch of R requests needs — the target's
paged latent cache, the drafter's context cache, the roots, the output buffer, the finished
flags, per-step statistics — allocated once, at fixed addresses.  One step is (design.md):

    draft logits [R, L, V] = drafter(root)            L = block_size - 1
    lp, ids [R, L, K]      = draft_topk(logits, K)    K = min(B, V)
    tree (N = B + 1)       = ddtree_build(lp, ids, root, B)
    logits [R, N, V], taps = target(tree tokens, committed_len + depth, visible)
    post [R, N]            = argmax, or Gumbel-max samples (sampling.py)
    acc                    = tree_accept(tree, post)
    kv_commit(all layers; rows and fp8 scales); lengths += accepted; drafter context += taps at the accepted path
    output buffer += the accepted drafts and the next root; EOS / max_new_tokens -> finished

Budget B = 0 is the autoregressive step (the root alone through the same cache and kernels).
Its taps are only stored (``DEFER_ROWS`` per request): the drafter's context projection runs for
them in one batch (the "flush", its own captured step; a second, of ``SHORT_FLUSH`` rows, after
a few) before the next tree step, or when the store is full, so autoregressive steps in a session with a drafter (``tree_budget="auto"`` with a
useless drafter runs mostly those) do not read the drafter's context weights each step.
Every shape is fixed by (R, block size, B) and nothing reads the device on the host, so on CUDA
each budget's step is captured once in a ``torch.cuda.CUDAGraph`` (warmed up on a side stream,
all graphs in one memory pool) and replayed.  Finished requests keep running, masked: they
commit nothing, emit nothing and write only at positions the next tree overwrites anyway.  An
eager CPU session, whose passes cost compute in proportion to their rows, leaves them out of the
tree passes instead (``_verify``: a cache view of the running requests' rows).

On CUDA the host looks at the device every ``sync_every`` steps (default 8: one ~10-50 us
stall per 8 steps), or sooner when fewer steps can still be needed (each step emits at least
one token per running request) or when the budget planner explores (one step, budget.py), so at
most 7 steps run after the last request finishes; that is when finished requests are noticed,
streamers get tokens and the budget planner updates.  On the CPU, where every op completes
before the next is issued, it looks after every step.  A step may emit past EOS or
``max_new_tokens``; the output is truncated afterwards, exactly where autoregressive generation
stops.
"""
from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.nn.functional as F

from torch_kdtree.ops import ddtree_build, draft_topk, draft_topk_merge, draft_topk_partial, tree_accept
from torch_kdtree.ops import value_checks

from ..parallel import vocab_shard

from .sampling import SamplingMode, SamplingParams, select_tokens

MAX_EOS = 8
# Autoregressive steps whose taps are stored before the drafter's context projection runs for them
# in one batch: its weights (K2 TP-8 rank: fc alone is 7168 x 7168, ~14 % of the AR step's bytes)
# are read once per this many AR steps instead of every step.  A flush after at most SHORT_FLUSH
# stored steps (a tree step soon after an AR one: a dipped tree, a look) runs the store's first
# SHORT_FLUSH rows only (a second captured flush), so the long store costs a long AR run nothing
# but memory (R x DEFER_ROWS x taps x hidden) and a short one no wasted rows.  Run 214 (H100,
# k2_slice, random drafter's AR steps): 16 rows 1.011x a plain session's AR step, 64 rows 1.003x.
DEFER_ROWS = 128
SHORT_FLUSH = 16
# Inductor options by name (compile_step="combo" / "tuned").  combo: independent kernels launched
# together (2p2b AR step 0.911 -> 0.833 ms on the H200, ~15 s compile); tuned: + coordinate-descent
# tuning of every kernel's launch config (~65-85 s compile per step the first time, then inductor's
# on-disk cache).  Tuning helped the inductor-reduction experts (run 30: 0.849 -> 0.737 ms) but
# adds nothing since kdtree::moe_gemv and the decode GEMV forms (run 31: 0.7299 ms combo, 0.7302
# tuned), nor on k2_slice (run 164: 0.3139 ms median tuned, 0.3146 combo).  RESULTS.md runs 28-31, 164.
INDUCTOR_OPTIONS = {"combo": {"combo_kernels": True},
                    "tuned": {"combo_kernels": True, "coordinate_descent_tuning": True}}
# Inductor's Triton kernels with programmatic dependent launch (inductor's ``triton.enable_pdl``):
# each kernel is launched while its predecessor finishes and waits on the device (griddepcontrol)
# before it reads what the predecessor wrote, so the norms, the router, argmax and the step's
# bookkeeping no longer start only after the previous kernel has drained -- as the kdtree decode
# kernels already do (csrc/pdl.cuh).  Added to the inductor options of every compiled step on a
# CUDA device of compute capability 9.0+ when this torch has the option (torch 2.11 does); the
# caller's own "triton.enable_pdl" wins, and PDL off (KDTREE_PDL=0 or torch_kdtree.ops.set_pdl,
# read when the session is built) leaves it out.  On the H200 (RESULTS.md run 99) k2_slice's
# decode step went 0.3608 -> 0.3503 ms and 2p2b's 0.6185 -> 0.6126 ms, same tokens.
PDL_OPTION = "triton.enable_pdl"
# Prompts of at most this many tokens prefill as one captured pass on CUDA (GenerationSession._chain_prefill):
# the eager prefill of the default pair (5 layers, 2 prompts of 60 and 78 tokens) launched 653 kernels in
# 19 ms of host time for 1.3 ms of GPU time on an H100 (bench/RESULTS.md, run 210), about as long as the
# 256 decoding steps after it.  Forced to longer prompts (run 223, H100, batch 2) the captured chain took
# 2.28 / 3.45 / 7.40 ms at 512 / 1,024 / 2,048 tokens against the eager prefill's 15.6 / 15.1 / 13.7 ms; its
# time grows faster than the prompt past 1,024 (its attention is one tree pass over an N x N mask), so longer
# prompts keep the eager prefill, whose host time their GPU time outgrows.
PREFILL_GRAPH_TOKENS = 1024
BUCKET_MAX_STEP = 1024  # the coarsest rounding of a session's prompt / output size (size_bucket)
PHASES = ("draft", "topk", "build", "verify", "accept", "commit")


def size_bucket(n: int) -> int:
    """A session's prompt or output size for n tokens: a multiple of 16 up to 128, then of an
    eighth of the next power of two (four sizes an octave, at most 25 % above n) up to 8,192, then
    of 1,024.  Each size is a session of its own (buffers, a compilation per budget, CUDA graphs),
    so short requests get few sizes; a long one allocates at most 1,023 tokens above its need
    (the KV planner's context: torch_kdtree.plan)."""
    step = min(BUCKET_MAX_STEP, max(16, 1 << max(0, (max(n, 1) - 1).bit_length() - 3)))
    return max(16, -(-n // step) * step)


def inductor_options(options: dict, device: torch.device) -> dict:
    """``options`` plus ``{PDL_OPTION: True}`` where that applies: a CUDA ``device`` of compute
    capability 9.0 or newer, a torch whose inductor has the option, the caller's ``options`` not
    setting it, and the kdtree kernels launching with PDL (``torch_kdtree.ops.pdl_enabled()``:
    ``KDTREE_PDL``, or ``set_pdl``).  A new dict; ``options`` is not changed."""
    import torch._inductor.config as inductor_config

    from torch_kdtree.ops import pdl_enabled

    out = dict(options)
    if (PDL_OPTION in out or not pdl_enabled() or device.type != "cuda"
            or not hasattr(inductor_config.triton, PDL_OPTION.split(".")[1])):
        return out
    if torch.cuda.get_device_capability(device)[0] >= 9:
        out[PDL_OPTION] = True
    return out


def _has_device_kernel(op: str, device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, device.type.upper())


def _state_tensors(module) -> dict:
    """The tensors a drafter keeps as attributes or buffers (its context caches), and its
    ``inner`` drafter's, by name."""
    if module is None:
        return {}
    found = {name: v for name, v in vars(module).items() if isinstance(v, torch.Tensor)}
    found.update({name: v for name, v in getattr(module, "_buffers", {}).items() if v is not None})
    inner = getattr(module, "inner", None)
    if inner is not None:
        found.update({f"inner.{k}": v for k, v in _state_tensors(inner).items()})
    return found


def _own_code(fn, name: str):
    """A function that calls ``fn(*args)`` through a code object of its own, named ``name``.

    Dynamo keeps its compiled graphs, guards and recompile count per code object.  Every
    session's step for every budget would otherwise enter through one shared code object (the
    step lambda, or ``_ar_step``), each new (session, budget) would be a recompile of it, and the
    ninth would hit dynamo's recompile limit (an error under ``fullgraph=True``).  With its own
    code object each step compiles once, keeps its own guards, and is freed with its session."""

    def step(*args):
        return fn(*args)

    names = {"co_name": name, **({"co_qualname": name} if hasattr(step.__code__, "co_qualname") else {})}
    step.__code__ = step.__code__.replace(**names)
    step.__name__ = step.__qualname__ = name
    return step


def _takes_tree_pass(prepare) -> bool:
    """Does a drafter's ``prepare`` take ``(root, tree_pass, nodes)`` (:class:`OracleDrafter`'s),
    or the root only?"""
    try:
        return "tree_pass" in inspect.signature(prepare).parameters
    except (TypeError, ValueError):
        return False


def _mesh_of(tp) -> str:
    """A tensor-parallel model's mesh, as words (``single device`` without one)."""
    if tp is None:
        return "a single device"
    return f"{tp.mesh.device_type} ranks {tp.mesh.mesh.tolist()}"


class StepPlans(dict):
    """The decode plan of each step a session captured, by budget (0: the autoregressive step)."""

    def __str__(self) -> str:
        return "\n".join(f"budget {b} ({'autoregressive' if b == 0 else f'tree of {b + 1} nodes'}): {plan}"
                         for b, plan in sorted(self.items()))


class PhaseTimer:
    """Per-phase wall time of one eager step: CUDA events on a GPU, perf_counter on the CPU
    (where ops run synchronously)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str | None, object]] = []

    def mark(self, phase: str | None) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        else:
            event = time.perf_counter()
        self.marks.append((phase, event))

    def millis(self) -> dict[str, float]:
        if self.cuda:
            self.marks[-1][1].synchronize()
        out = {f"{p}_ms": 0.0 for p in PHASES}
        for (phase, start), (_, end) in zip(self.marks, self.marks[1:]):
            if phase is not None:
                ms = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
                out[f"{phase}_ms"] += ms
        out["total_ms"] = sum(out[f"{p}_ms"] for p in PHASES)
        return out


class GenerationSession:
    """Buffers and captured steps for R requests (module docstring).

    Args:
        target: a :class:`KimiK2ForCausalLM` (eval mode).
        drafter: None (autoregressive only) or a drafter with the DFlash protocol
            (``block_size``, ``target_layer_ids``, ``setup_cache``, ``reset_context``,
            ``append_context``, ``forward(root) -> logits [R, L, V]``; optional ``bind_target``
            and ``attach(target, cache)``).
        batch_size: R.
        max_prompt, max_new: longest prompt and ``max_new_tokens`` the buffers must hold.
        budgets: the budgets with a step (0 = autoregressive); each gets its own graph.
        mode: greedy or sampling (:class:`SamplingMode`), fixed per session.
        page_size: tokens per page of the target's cache.
        kv_cache_dtype: the target cache's storage: ``"auto"`` (the target's dtype), ``"fp8"``
            (e4m3 rows with per-token scales; attention then runs in torch ops) or a dtype name
            (``KimiK2Cache``).
        cuda_graphs: capture and replay on CUDA (ignored on the CPU).
        compile_step: run each step through ``torch.compile(fullgraph=True)`` (captured in the
            graphs on CUDA); True for inductor, ``"combo"`` / ``"tuned"`` for inductor with
            :data:`INDUCTOR_OPTIONS`, a backend name (e.g. ``"aot_eager"``), or a dict of
            inductor options (e.g. ``{"combo_kernels": True}``); inductor compiles get
            :func:`inductor_options` (programmatic dependent launch on sm_90+).
        sync_every: steps between host checks.
        prefill_chunk_size: prompt tokens per prefill pass (None: the model's default,
            ``modeling.PREFILL_CHUNK`` = 8192): a long prompt is prefilled chunk by chunk, each
            chunk committed to the cache and the drafter's context before the next, so a
            200k-token prompt needs memory for one chunk (:meth:`prefill`).
        chain_prefill: prompts of at most this many tokens prefill as one tree pass whose tree
            is the prompt's chain (:meth:`_chain_prefill`; 0: never), captured in a CUDA graph per
            prompt size (:func:`size_bucket`) where the steps are; None (default):
            :data:`PREFILL_GRAPH_TOKENS` in a session with CUDA graphs, else 0.
        defer_rows: AR steps whose taps are stored before the drafter's context projection runs
            for them in one batch (None: :data:`DEFER_ROWS`; a session with AR and tree budgets).
    """

    def __init__(self, target, drafter, *, batch_size: int, max_prompt: int, max_new: int, budgets,
                 mode: SamplingMode = SamplingMode(), page_size: int = 64, cuda_graphs: bool = True,
                 compile_step: bool | str | dict = False, sync_every: int = 8,
                 kv_cache_dtype: str | torch.dtype = "auto", prefill_chunk_size: int | None = None,
                 chain_prefill: int | None = None, defer_rows: int | None = None):
        from torch_kdtree.models.kimi_k2 import KimiK2Cache
        from torch_kdtree.models.kimi_k2.modeling import prefill_chunk

        self.prefill_chunk_size = prefill_chunk(prefill_chunk_size)
        self.target, self.drafter = target, drafter
        # tensor parallelism (models/parallel.py): logits are vocabulary shards; host decisions are rank 0's
        self.tp = getattr(target, "tp", None)
        # a drafter's logits must be sharded as the target's: a DFlash drafter (an oracle's ``inner``
        # one) parallelised over the same mesh; an oracle's own logits follow its target (oracle.py)
        sharded = getattr(drafter, "inner", None) if getattr(drafter, "prepare", None) is not None else drafter
        drafter_tp = getattr(sharded, "tp", None)
        if sharded is not None and _mesh_of(drafter_tp) != _mesh_of(self.tp):
            what = "the oracle's inner drafter" if sharded is not drafter else "the drafter"
            raise ValueError(f"GenerationSession: {what} is parallelised over {_mesh_of(drafter_tp)} but the "
                             f"target over {_mesh_of(self.tp)}; parallelize both over the same device mesh")
        self.device = target.device
        self.R, self.mode, self.sync_every = batch_size, mode, max(1, int(sync_every))
        self.vocab = target.config.vocab_size
        self.budgets = tuple(sorted(set(int(b) for b in budgets)))
        if drafter is None and any(self.budgets):
            raise ValueError("GenerationSession: tree budgets need a drafter")
        self.block_size = drafter.block_size if drafter is not None else 1
        L = self.L = self.block_size - 1
        self.taps = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.max_prompt, self.max_new = max_prompt, max_new
        nodes = max(self.budgets) + 1
        self.capacity = max_prompt + max_new + L + max(nodes, L) + 2
        self.width = max_new + L + 2  # the last column is the sink for masked writes
        self.max_steps = max_new + self.sync_every + 1
        dev = self.device
        self.cache = KimiK2Cache.for_model(target, batch_size, self.capacity, page_size=page_size,
                                           dtype=target.dtype, device=dev, kv_cache_dtype=kv_cache_dtype)
        if drafter is not None:
            if hasattr(drafter, "bind_target"):
                drafter.bind_target(target.model.embed_tokens, target.lm_head)
            drafter.setup_cache(batch_size, max_prompt + max_new + L + 2, device=dev)
            if hasattr(drafter, "attach"):
                drafter.attach(target, self.cache)
        # Each step shape's decode plan (which kernels every layer runs), made once here:
        # budget 0 is one token per request, budget B a tree of B + 1 nodes.
        self.plan = StepPlans({b: target.model.plan_pass(batch_size, b + 1 if b else 1, tree=True, cache=self.cache,
                                                         dtype=target.dtype, compiled=bool(compile_step))
                               for b in self.budgets})
        self.params = SamplingParams(batch_size, self.vocab, dev)
        self.root = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.out = torch.zeros(batch_size, self.width, dtype=torch.int64, device=dev)
        self.out_len = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.done = torch.ones(batch_size, dtype=torch.bool, device=dev)  # nothing commits before a prefill
        self.max_new_t = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.eos = torch.full((MAX_EOS,), -1, dtype=torch.int64, device=dev)
        # the ids this rank's logits columns cover (plain ints: no rank query inside a traced step)
        self.vocab_start, self.vocab_local = vocab_shard(self.tp, self.vocab)
        # min_new_tokens (mode.min_new): per request, and which of this rank's logits columns are an EOS
        self.min_new_t = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.eos_columns = torch.zeros(self.vocab_local, dtype=torch.bool, device=dev)
        # repetition_penalty (mode.penalty): which of this rank's columns each request's prompt and
        # output hold (one more column: the sink of masked writes), and the penalty per request
        self.seen = torch.zeros(batch_size, self.vocab_local + 1, dtype=torch.bool, device=dev)
        self.penalty_t = torch.ones(batch_size, dtype=torch.float32, device=dev)
        self.step_no = torch.zeros(1, dtype=torch.int64, device=dev)
        self.accept_log = torch.zeros(self.max_steps, batch_size, dtype=torch.int32, device=dev)
        # counterfactual accept lengths per budget: sums and request-steps, one buffer (one read a look)
        # (sums, request-steps, sums of squares: the planner's noise estimate)
        self.cf = torch.zeros(3, len(self.budgets), dtype=torch.float32, device=dev)
        self._ones = torch.ones(batch_size, 1, 1, dtype=torch.bool, device=dev)
        self._topk_kernel = _has_device_kernel("kdtree::draft_topk", dev)
        # The drafter's state tensors as the graphs saw them; holding them keeps them alive (a
        # graph must never write to freed memory) and tells when another session replaced them.
        self._drafter_tensors = _state_tensors(drafter)
        self._prepare = getattr(drafter, "prepare", None) if drafter is not None else None
        self._timer: PhaseTimer | None = None
        self._timing: list | None = None
        self.graphs: dict = {}
        self.use_graphs = cuda_graphs and dev.type == "cuda"
        if chain_prefill is None:
            chain_prefill = PREFILL_GRAPH_TOKENS if self.use_graphs else 0
        if isinstance(chain_prefill, bool) or not isinstance(chain_prefill, int) or chain_prefill < 0:
            raise ValueError(f"GenerationSession: chain_prefill must be an int >= 0 (prompt tokens), got {chain_prefill!r}")
        # a short prompt's inputs at fixed addresses, for its captured prefill (_chain_prefill)
        self._prefill_ids = torch.zeros(batch_size, min(chain_prefill, max_prompt), dtype=torch.int64, device=dev)
        self._prefill_lengths = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.prefill_plans: dict[int, object] = {}  # the chain prefill's plan per prompt size
        self._gen_max_new, self._gen_eos = 0, []
        self._fns = {b: self._step_fn(b) for b in self.budgets}
        # tree passes over the running requests only (_verify): eager CPU sessions of one process
        self._compact = dev.type == "cpu" and not compile_step and self.tp is None
        self._compiled = bool(compile_step)
        self._row_plans: dict = {}
        # the AR step's taps, kept for the drafter until a tree step needs its context (_flush)
        if defer_rows is None:
            defer_rows = DEFER_ROWS
        if isinstance(defer_rows, bool) or not isinstance(defer_rows, int) or defer_rows < 1:
            raise ValueError(f"GenerationSession: defer_rows must be an int >= 1 (AR steps), got {defer_rows!r}")
        self.defer = defer_rows if drafter is not None and self.taps and 0 in self.budgets and any(self.budgets) \
            else 0
        self._deferred = 0  # AR steps since the last flush (host count: no device read)
        if self.defer:
            width = len(self.taps) * target.config.hidden_size
            self.pending = torch.zeros(batch_size, self.defer, width, dtype=target.dtype, device=dev)
            self.pending_n = torch.zeros(batch_size, dtype=torch.int64, device=dev)
            self._fns["flush"] = lambda: self._flush(self.defer)
            if self.defer > SHORT_FLUSH:
                self._fns["flush_short"] = lambda: self._flush(SHORT_FLUSH)
        # The oracle's look-ahead (its ``prepare``): with a ``tree_pass`` argument, through each
        # budget's own verify pass (_lookahead_pass), so that its greedy tokens are the verify's
        # own (the same kernels, plan and row count; one-token passes round differently and, on
        # a random target's flat logits, choose differently); that pass is compiled like a step,
        # the look-ahead around it stays eager (captured on CUDA): L unrolled passes would compile
        # for minutes.  A drafter whose prepare takes the root only keeps one compiled look-ahead.
        self._passes: dict = {}  # budget -> its verify pass for the look-ahead (keys ("prepare", budget))
        if self._prepare is not None and any(self.budgets):
            if _takes_tree_pass(self._prepare):
                for b in self.budgets:
                    if b:
                        self._passes[b] = lambda *a, b=b: self._lookahead_pass(b, *a)
                        self._fns["prepare", b] = lambda b=b: self._prepare(self.root, self._passes[b], b + 1)
            else:
                self._fns["prepare"] = lambda: self._prepare(self.root)
        if compile_step:
            if compile_step in ("combo", "tuned"):
                compile_step = INDUCTOR_OPTIONS[compile_step]
            if compile_step is True or isinstance(compile_step, dict):  # inductor (with these options)
                options = inductor_options({} if compile_step is True else compile_step, dev)
                how = {"backend": "inductor", **({"options": options} if options else {})}
            else:
                how = {"backend": compile_step}
            self._fns = {k: f if isinstance(k, tuple) else  # ("prepare", B): eager around its compiled pass
                         torch.compile(_own_code(f, f"step_{k}"), fullgraph=True, dynamic=False, **how)
                         for k, f in self._fns.items()}
            self._passes = {b: torch.compile(_own_code(f, f"lookahead_{b}"), fullgraph=True, dynamic=False, **how)
                            for b, f in self._passes.items()}
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()
            for key, fn in self._fns.items():
                self._capture(key, fn)
            self.reset()

    # ------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------
    def _phase(self, name: str | None) -> None:
        if self._timer is not None:
            self._timer.mark(name)

    def _draft_topk(self, logits: torch.Tensor, k: int):
        tp = self.tp
        if tp is not None and logits.shape[-1] * tp.world == self.vocab:  # this rank's vocabulary shard
            if k > logits.shape[-1]:
                logits = tp.all_gather(logits, -1)
            else:  # each shard's top-k, gathered, merged: the ids of the unsplit top-K
                part = draft_topk_partial(logits.contiguous(), k, tp.rank * logits.shape[-1])
                return draft_topk_merge(tp.stack(part.values), tp.stack(part.token_ids), tp.stack(part.lse), k)
        if self._topk_kernel:
            return draft_topk(logits.contiguous(), k)
        lp = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # no kernel on this device yet
        return lp.values.contiguous(), lp.indices.contiguous()

    def _ddtree_step(self, budget: int) -> None:
        drafter, cache = self.drafter, self.cache
        active = ~self.done
        self._phase("draft")
        draft_logits = drafter(self.root)
        self._phase("topk")
        lp, ids = self._draft_topk(draft_logits, min(budget, self.vocab))
        self._phase("build")
        tree = ddtree_build(lp, ids, self.root, budget)
        self._phase("verify")
        positions = cache.lengths.long()[:, None] + tree.depths.clamp(min=0).long()
        logits, taps = self._verify(tree, positions, budget, active)
        post = self._select(logits, tree.depths.clamp(min=0).long(), tree)
        self._phase("accept")
        acc = tree_accept(tree.tokens, tree.parents, post)
        self._phase("commit")
        count = torch.where(active, acc.lengths, 0)
        cache.commit(acc.indices, count)
        drafter.append_context(taps, count, indices=acc.indices[:, : self.block_size])
        cache.advance(count)
        # emitted this step: the accepted drafts (path nodes 1..a-1), then the next root
        path = tree.tokens.gather(1, acc.indices.clamp(min=0).long())[:, 1 : self.L + 2]
        path = F.pad(path, (0, self.L + 1 - path.shape[1]))
        j = torch.arange(self.L + 1, device=path.device)
        new = torch.where(j[None, :] == (count.long() - 1)[:, None], acc.next_tokens[:, None], path)
        self._emit(new, count, active)
        self.root.copy_(torch.where(active, acc.next_tokens, self.root))
        self._record(count, active, acc.indices, budget)
        self._phase(None)

    def _verify(self, tree, positions, budget: int, active):
        """The target's pass over the tree: (logits [R, N, V], taps [R, N, taps * H]).  In an eager
        CPU session (no graphs, no compile, one process), where compute grows with the rows and the
        host knows ``done`` after every step, the pass runs over the running requests only once
        some have finished (a cache view of their rows, :meth:`KimiK2Cache.rows`); the finished
        rows' logits and taps are zeros, which they neither commit nor emit."""
        target = self.target
        if self._compact:
            rows = active.nonzero().squeeze(1)
            n = rows.numel()
            if 0 < n < self.R:
                sub = self.cache.rows(rows)
                plan = self._row_plans.get((budget, n))
                if plan is None:
                    plan = self._row_plans[budget, n] = target.model.plan_pass(n, budget + 1, tree=True, cache=sub,
                                                                               dtype=target.dtype)
                part = target(tree.tokens[rows], positions[rows], sub, tree.visible[rows], tap_layers=self.taps,
                              plan=plan)
                logits = part.logits.new_zeros(self.R, *part.logits.shape[1:])
                logits[rows] = part.logits
                taps = None
                if part.taps is not None:
                    taps = part.taps.new_zeros(self.R, *part.taps.shape[1:])
                    taps[rows] = part.taps
                return logits, taps
        out = target(tree.tokens, positions, self.cache, tree.visible, tap_layers=self.taps, plan=self.plan[budget])
        return out.logits, out.taps

    def _lookahead_pass(self, budget: int, tokens, positions, visible):
        """The verify's target pass at ``budget`` (its plan, its [R, budget + 1] rows, the same
        taps) over the given nodes: (logits, taps).  The oracle's look-ahead runs it."""
        out = self.target(tokens, positions, self.cache, visible, tap_layers=self.taps, plan=self.plan[budget])
        return out.logits, out.taps

    def _look_ahead(self, budget: int) -> None:
        """The drafter's look-ahead before a step at ``budget`` (an oracle's ``prepare``), if any."""
        if budget and self._prepare is not None:
            key = ("prepare", budget) if budget in self._passes else "prepare"
            self._run(key, self._fns[key])

    def _ar_step(self) -> None:
        target, cache = self.target, self.cache
        active = ~self.done
        self._phase("verify")
        out = target(self.root[:, None], cache.lengths.long()[:, None], cache, self._ones, tap_layers=self.taps,
                     plan=self.plan[0])
        post = self._select(out.logits)[:, 0]
        self._phase("commit")
        count = active.to(torch.int32)
        if self.defer:  # stored: the next tree step's flush appends them to the drafter's context
            rows = torch.arange(self.R, device=count.device)
            self.pending.index_put_((rows, self.pending_n.clamp(max=self.defer - 1)), out.taps[:, 0])
            self.pending_n.add_(count.long())
        elif self.drafter is not None:  # keeps the drafter's context whole when "auto" switches back
            self.drafter.append_context(out.taps, count)
        cache.advance(count)
        self._emit(post[:, None], count, active)
        self.root.copy_(torch.where(active, post, self.root))
        self._record(count, active, None, 0)
        self._phase(None)

    def _select(self, logits: torch.Tensor, depths: torch.Tensor | None = None, tree=None) -> torch.Tensor:
        """The target's token at each node (select_tokens), after transformers' logits processors
        in their order:

        - repetition_penalty (``mode.penalty``): node (r, i)'s prediction follows the prompt, the
          emitted tokens (``seen``) and the drafts on its path below the root (``tree``: its
          ``visible`` row); each of those columns is divided by the penalty (multiplied where
          negative).  None: the root alone (an AR step, a prefill), whose tokens are all emitted.
        - min_new_tokens (``mode.min_new``): the end-of-sequence columns are masked at nodes
          before their request's ``min_new_tokens``-th new token: node (r, i) at ``depths[r, i]``
          below the root (None: the root alone) predicts token number out_len[r] + depth + 1."""
        if self.mode.penalty:
            V = self.vocab_local
            scores = logits.float()
            p = self.penalty_t[:, None, None]
            penalised = torch.where(scores < 0, scores * p, scores / p)
            logits = torch.where(self.seen[:, None, :V], penalised, scores)
            if tree is not None:  # the drafts on each node's path: [R, N, N] = visible x their tokens
                # A penalty moves a value one way (down for p > 1, up for p < 1), so the path's
                # columns take min (max) with their penalised value: a column already penalised
                # (seen) or on the path twice stays penalised once, and no [R, N, V] mask is built.
                local = tree.tokens - self.vocab_start
                mine = (local >= 0) & (local < V)
                col = torch.where(mine, local, 0)[:, None, :].expand(tree.visible.shape)  # [R, N, N]
                on_path = tree.visible & mine[:, None, :]
                value = penalised.gather(-1, col)
                down, up = p > 1, p < 1
                logits = logits.scatter_reduce(-1, col, torch.where(on_path & down, value, float("inf")), reduce="amin")
                logits = logits.scatter_reduce(-1, col, torch.where(on_path & up, value, float("-inf")), reduce="amax")
        if self.mode.min_new:
            made = self.out_len[:, None] + (0 if depths is None else depths)
            early = made < self.min_new_t[:, None]  # [R, N]
            logits = logits.masked_fill(early[..., None] & self.eos_columns, float("-inf"))
        return select_tokens(logits, self.mode, self.params, self.tp)

    def _mark_seen(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """``seen[r, t] = True`` for this rank's columns of tokens [R, A] where ``valid``; the
        rest go to the sink column (every write is True, so repeated columns are harmless)."""
        V = self.vocab_local
        local = tokens - self.vocab_start
        col = torch.where(valid & (local >= 0) & (local < V), local, V)
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(col)
        self.seen.index_put_((rows, col), torch.ones_like(col, dtype=torch.bool))

    def _flush(self, rows: int) -> None:
        """Append the stored AR steps' taps to the drafter's context (rows in step order), from the
        store's first ``rows`` rows (each request has at most the stored steps' count there)."""
        self.drafter.append_context(self.pending[:, :rows], self.pending_n)
        self.pending_n.zero_()

    def _run_flush(self) -> None:
        """The flush of the ``_deferred`` stored AR steps: eagerly, exactly their rows; compiled
        or captured (fixed shapes), the short flush when they fit it, else the whole store."""
        if self.use_graphs or self._compiled:
            key = "flush_short" if self._deferred <= SHORT_FLUSH and "flush_short" in self._fns else "flush"
            self._run(key, self._fns[key])
        else:
            rows = self._deferred
            self._run("flush", lambda: self._flush(rows))
        self._deferred = 0

    def _flush_due(self, budget: int) -> bool:
        """Whether a step at ``budget`` needs the flush first: a tree step (the drafter reads its
        context) or an AR step that would overfill the store, after stored AR steps."""
        return bool(self._deferred) and (budget > 0 or self._deferred == self.defer)

    def _emit(self, new: torch.Tensor, count: torch.Tensor, active: torch.Tensor) -> None:
        """Append new[r, :count[r]] to the output of the active requests; mark finished ones."""
        j = torch.arange(new.shape[1], device=new.device)
        valid = (j[None, :] < count[:, None]) & active[:, None]
        col = torch.where(valid, self.out_len[:, None] + j, self.width - 1).clamp(max=self.width - 1)
        # index_put_, not scatter_: inductor fuses it into the step's bookkeeping kernel, where
        # scatter_ ran as a separate ATen kernel (RESULTS.md run 101); the masked writes share the
        # sink column either way
        rows = torch.arange(new.shape[0], device=new.device)[:, None].expand_as(col)
        self.out.index_put_((rows, col), new)
        if self.mode.penalty:
            self._mark_seen(new, valid)
        hit_eos = (self._is_eos(new) & valid).any(1)
        self.out_len.add_(torch.where(active, count.long(), 0))
        self.done.logical_or_(hit_eos | (self.out_len >= self.max_new_t))

    def _is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        # a broadcast compare: torch.isin may sort and unique (a host sync) for other sizes
        return (tokens[..., None] == self.eos).any(-1)

    def _record(self, count, active, indices, budget: int) -> None:
        step = self.step_no.clamp(max=self.max_steps - 1)
        self.accept_log.index_copy_(0, step, count.to(torch.int32)[None])
        self.step_no.add_(1)
        n_active = active.sum().float()
        for i, b in enumerate(self.budgets):  # counterfactual accept lengths (budget.py)
            if 0 < b <= budget:
                within = ((indices >= 0) & (indices <= b)).sum(1).float()
                self.cf[0, i] += (within * active).sum()
                self.cf[1, i] += n_active
                self.cf[2, i] += (within * within * active).sum()

    def _step_fn(self, budget: int):
        return self._ar_step if budget == 0 else (lambda: self._ddtree_step(budget))

    # ------------------------------------------------------------------------------------
    # graphs, running steps
    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, key, fn, before=None) -> None:
        """Capture ``fn`` as ``self.graphs[key]`` after two warm-up runs on a side stream (each
        after ``before()``, when given: e.g. a reset, so that a prefill's warm-ups start empty)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), value_checks(False):
            for _ in range(2):  # lazy initialisation and compilation happen outside the capture
                if before is not None:
                    before()
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with value_checks(False), torch.cuda.graph(graph, pool=self._pool):
            fn()
        self.graphs[key] = graph

    def _unchecked(self):
        """The context eager work of this session runs in: on CUDA without the ops' value checks
        (each a host sync; the session sized its buffers and checked its inputs), as in a capture;
        on the CPU, where they cost no sync, with them."""
        return value_checks(False) if self.device.type == "cuda" else nullcontext()

    def _run(self, key, fn) -> None:
        if self.use_graphs and self._timer is None:
            self.graphs[key].replay()
            return
        with self._unchecked():
            fn()

    @torch.no_grad()
    def step(self, budget: int) -> None:
        """One step at ``budget``: graph replays on CUDA, else eagerly.  A drafter with a
        ``prepare(root)`` (the oracle's look-ahead) runs it first, outside the step proper (its
        own graph), so that step timings (:meth:`run`, :meth:`measure_step_seconds`) leave it out."""
        self._look_ahead(budget)
        if self._timing is not None:
            self._timing.append(self._clock())
        if self._flush_due(budget):  # inside the timed region: it is part of what the steps cost
            self._run_flush()
        self._run(budget, self._fns[budget])
        if self._timing is not None:
            self._timing.append(self._clock())
        self._deferred += self.defer > 0 and budget == 0

    def _clock(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start, end) -> float:
        """Seconds between two _clock() marks (CUDA events: both completed, after a synchronisation)."""
        return start.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - start

    def _timed_seconds(self) -> float:
        """Seconds inside the steps recorded since timing started (after a synchronisation)."""
        marks, self._timing = self._timing, None
        return sum(self._seconds(a, b) for a, b in zip(marks[::2], marks[1::2]))

    def prefill_seconds(self) -> float:
        """The last prefill's time through the first token (read after the decoding loop, which
        synchronises; CUDA events on a GPU, the host's clock on the CPU)."""
        return self._seconds(*self._prefill_marks)

    @torch.no_grad()
    def profile_step(self, budget: int) -> dict:
        """One eager step with per-phase times (ms) and the accept lengths (synchronises)."""
        self._look_ahead(budget)
        self._timer = PhaseTimer(self.device)
        try:
            if self._flush_due(budget):
                self._phase("commit")  # the stored AR taps' flush counts as commit work
                self._flush(self._deferred)
                self._deferred = 0
            self._run(budget, self._step_fn(budget))  # eager, uncompiled: the phase marks run
            times = self._timer.millis()
        finally:
            self._timer = None
        self._deferred += self.defer > 0 and budget == 0
        step = int(self.step_no) - 1
        return {"budget": budget, "accept": self.accept_log[min(step, self.max_steps - 1)].tolist(), **times}

    @torch.no_grad()
    def time_steps(self, budget: int, steps: int) -> float:
        """Mean seconds per step of ``steps`` steps at ``budget`` from the current state (they
        commit tokens like any step); only the step proper is timed (no oracle look-ahead)."""
        self._timing = []
        for _ in range(steps):
            self.step(budget)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return self._timed_seconds() / steps

    def measure_step_seconds(self, budgets, repeats: int = 3) -> dict[int, float]:
        """Seconds per step of each budget on a scratch state (then :meth:`reset`).  Taken
        right after the graphs are captured, with short contexts (MoE and weight traffic,
        not attention, dominate the step at these lengths)."""
        seconds = {}
        for b in budgets:
            self.reset()
            self.step(b)  # warm
            seconds[b] = self.time_steps(b, repeats)
        self.reset()
        return seconds

    def run(self, policy, *, profile: bool = False, on_poll=None) -> dict:
        """Step until every request is finished, looking at the device every ``sync_every``
        steps on CUDA (every step on the CPU) or sooner when fewer steps can still be needed.

        ``policy`` gives the budget (``.current``) and the segment's length (``.segment_steps``,
        at most ``sync_every``; None: ``sync_every``) and sees each segment's counterfactual
        accept lengths, step time and steps (``.observe``, budget.py); ``on_poll()`` runs after each
        look.  Returns the budget of every step, the profile rows (``profile=True``: eager
        steps with per-phase times) and ``step_seconds``, the time spent inside the steps
        (CUDA events around each step; no prefill, no oracle look-ahead, no host gaps).
        """
        budgets, rows, step_seconds = [], [], 0.0
        cuda = self.device.type == "cuda"
        remaining = self.remaining()
        while remaining:
            if len(budgets) > self.max_new + self.sync_every:
                raise RuntimeError("generate: requests did not finish within max_new_tokens steps (internal error)")
            budget = policy.current
            # the policy may ask for a shorter segment (one exploring step, budget.py); never longer
            steps = min(getattr(policy, "segment_steps", None) or self.sync_every, self.sync_every if cuda else 1,
                        remaining)
            self._timing = [] if not profile else None
            for _ in range(steps):
                if profile:
                    rows.append(self.profile_step(budget))
                else:
                    self.step(budget)
                budgets.append(budget)
            remaining = self.remaining()
            seconds = self._timed_seconds() if not profile else sum(r["total_ms"] for r in rows[-steps:]) / 1e3
            step_seconds += seconds
            # a fixed budget needs no counterfactuals (two device reads a look saved) and no broadcast
            adaptive = getattr(policy, "adaptive", True)
            policy.observe(budget, self.take_counterfactuals() if adaptive else {},
                           None if profile else seconds / steps, steps)
            if self.tp is not None and adaptive:  # every rank runs the same steps: rank 0's choice (its timings)
                choice = self.tp.broadcast_object((policy.current, getattr(policy, "segment_steps", None)))
                policy.current = choice[0]
                if hasattr(policy, "segment_steps"):
                    policy.segment_steps = choice[1]
            if on_poll is not None:
                on_poll()
        return {"budgets": budgets, "profile": rows, "step_seconds": step_seconds}

    # ------------------------------------------------------------------------------------
    # host side: reset, prefill, polling
    # ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every request (buffers keep their addresses)."""
        self.cache.reset()
        if self.drafter is not None:
            self.drafter.reset_context()
        if self.defer:
            self.pending_n.zero_()
        self._deferred = 0
        for t in (self.root, self.out, self.out_len, self.max_new_t, self.step_no, self.accept_log, self.cf):
            t.zero_()
        self.done.fill_(True)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, *, max_new: int, eos: list[int],
                sampling: tuple[float, int | None, float | None, float | None] | None = None,
                prefill_chunk_size: int | None = None, min_new_tokens: int = 0,
                repetition_penalty: float = 1.0) -> None:
        """Start R requests: right-padded prompts ``ids`` [R, T] with ``lengths`` [R]; the
        first token is chosen here (as every later one: argmax or a Gumbel-max sample).

        The prompts go through the target in chunks of ``prefill_chunk_size`` tokens (None: the
        session's), each chunk committed (the cache's lengths, the drafter's context) before the
        next attends to it; only each request's last hidden state is kept, so memory is bounded
        by the chunk, and the cache, the drafter's context and the first token are those of a
        one-pass prefill (to fp32 rounding).  ``min_new_tokens``: no end-of-sequence token before
        that many new tokens (a session built with ``mode.min_new``); ``repetition_penalty``: on
        the prompt's and the output's tokens (``mode.penalty``).

        Prompts of at most ``chain_prefill`` tokens (a session with CUDA graphs:
        :data:`PREFILL_GRAPH_TOKENS`) that fit one chunk go through the target as one tree pass
        over each prompt's chain instead (:meth:`_chain_prefill`), captured once per prompt size."""
        from torch_kdtree.models.kimi_k2.modeling import prefill_chunk

        R, T = ids.shape
        if R != self.R or T > self.max_prompt or max_new > self.max_new:
            raise ValueError(f"GenerationSession: built for R={self.R}, prompts <= {self.max_prompt}, "
                             f"max_new <= {self.max_new}; got R={R}, T={T}, max_new={max_new}")
        if len(eos) > MAX_EOS:
            raise ValueError(f"generate: at most {MAX_EOS} eos_token_id values, got {len(eos)}")
        chunk = self.prefill_chunk_size if prefill_chunk_size is None else prefill_chunk(prefill_chunk_size)
        start = self._clock()
        counts = torch.as_tensor(lengths)  # one host read: the chain prefill's indices need no device checks
        if counts.shape != (R,) or (R and not 0 <= int(counts.min()) <= int(counts.max()) <= T):
            raise ValueError(f"GenerationSession.prefill: lengths must be [R = {R}] values in [0, T = {T}], "
                             f"got {counts.tolist()}")
        longest = int(counts.max()) if R else 0
        ids = ids[:, : max(longest, 1)].to(self.device)
        lengths = lengths.to(self.device, torch.int64)
        tokens = self._chain_tokens(ids.shape[1], chunk)
        if tokens:  # one pass over the prompt's chain, captured per prompt size (_chain_prefill)
            self._prefill_ids[:, : ids.shape[1]].copy_(ids)
            self._prefill_ids[:, ids.shape[1]:].zero_()
            self._prefill_lengths.copy_(lengths)
            if tokens not in self.prefill_plans:
                self.prefill_plans[tokens] = self.target.model.plan_pass(R, tokens, tree=True, cache=self.cache,
                                                                         dtype=self.target.dtype)
            if self.use_graphs and ("prefill", tokens) not in self.graphs:
                self._capture(("prefill", tokens), lambda: self._chain_prefill(tokens), before=self.reset)
        self.reset()
        if sampling is not None:
            if replace(self.params.set(*sampling), min_new=self.mode.min_new, penalty=self.mode.penalty) != self.mode:
                raise ValueError("GenerationSession: sampling parameters need a different captured mode")
        if min_new_tokens and not self.mode.min_new:
            raise ValueError("GenerationSession: min_new_tokens needs a session built with SamplingMode(min_new=True)")
        if repetition_penalty != 1.0 and not self.mode.penalty:
            raise ValueError("GenerationSession: repetition_penalty needs a session built with SamplingMode(penalty=True)")
        if not repetition_penalty > 0:
            raise ValueError(f"generate: repetition_penalty must be > 0, got {repetition_penalty}")
        self.penalty_t.fill_(float(repetition_penalty))
        self.eos[: len(eos)] = torch.tensor(eos, dtype=torch.int64)
        self.min_new_t.fill_(int(min_new_tokens))
        self.eos_columns.zero_()
        local = [e - self.vocab_start for e in eos if 0 <= e - self.vocab_start < self.vocab_local]
        if local:
            self.eos_columns[torch.tensor(local, dtype=torch.int64, device=self.device)] = True
        self.max_new_t.fill_(max_new)
        self._gen_max_new, self._gen_eos = max_new, list(eos)
        if tokens:
            self._run(("prefill", tokens), lambda: self._chain_prefill(tokens))
            self._prefill_marks = (start, self._clock())
            return
        rows = torch.arange(R, device=self.device)
        last = None
        # as the steps run (_run); the eager prefill keeps the syncs its shapes need: the valid
        # tokens' slots and the longest key count
        with self._unchecked():
            for c0 in range(0, ids.shape[1], chunk):
                part = ids[:, c0 : c0 + chunk]
                n = (lengths - c0).clamp(0, part.shape[1])
                out = self.target(part, cache=self.cache, input_lengths=n, tap_layers=self.taps,
                                  return_logits=False, prefill_chunk_size=chunk)
                hidden = out.last_hidden_state[rows, (lengths - 1 - c0).clamp(0, part.shape[1] - 1)]
                ends_here = (lengths - 1 >= c0) & (lengths - 1 < c0 + part.shape[1])
                last = hidden if last is None else torch.where(ends_here[:, None], hidden, last)
                self.cache.advance(n)
                if self.drafter is not None:
                    self.drafter.append_context(out.taps, n)
                del out
        self._first_token(last, ids, torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None])
        self._prefill_marks = (start, self._clock())

    def _chain_tokens(self, T: int, chunk: int) -> int:
        """The chain prefill's size for a prompt of T tokens (:func:`size_bucket`, within the
        session's buffers and the prefill chunk), or 0: the prompt takes the eager prefill."""
        if T > self._prefill_ids.shape[1]:
            return 0
        tokens = min(size_bucket(T), self._prefill_ids.shape[1])
        return tokens if tokens <= chunk else 0

    def _chain_prefill(self, tokens: int) -> None:
        """Prefill the prompts staged in ``_prefill_ids[:, :tokens]`` (right-padded, lengths
        ``_prefill_lengths``) as one tree pass whose tree is each prompt's chain: node i is token
        i at position i and sees nodes 0..i, which is causal attention over the prompt.  The
        tree pass writes every node's latent at ``lengths + i`` like a step's; only the prompt's
        own are committed, and the padding nodes after it (seeing the prompt, never seen) sit
        where the first step writes anyway.  The same kernels as the tree steps and no host reads,
        so on CUDA it is captured once per prompt size and replayed: one launch instead of the
        eager prefill's hundreds (:data:`PREFILL_GRAPH_TOKENS`).  Its values are those of the
        eager prefill to rounding (the absorbed attention form instead of the expanded one)."""
        ids, n = self._prefill_ids[:, :tokens], self._prefill_lengths
        t = torch.arange(tokens, device=self.device)
        visible = (t[:, None] >= t[None, :]).expand(self.R, tokens, tokens)
        positions = self.cache.lengths.long()[:, None] + t[None, :]
        out = self.target(ids, positions, self.cache, visible, tap_layers=self.taps, return_logits=False,
                          plan=self.prefill_plans[tokens])
        rows = torch.arange(self.R, device=self.device)
        last = out.last_hidden_state[rows, (n - 1).clamp(min=0)]
        self.cache.advance(n)
        if self.drafter is not None:
            self.drafter.append_context(out.taps, n)
        self._first_token(last, ids, t[None, :] < n[:, None])

    def _first_token(self, last: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> None:
        """The first new token of each request from its prompt's last hidden state ``last`` [R, H]
        (prompts ``ids`` [R, T], their tokens where ``valid``): chosen as every later one, written
        as the root, the first output and the finished flags."""
        if self.mode.penalty:  # the prompts' tokens
            self.seen.zero_()
            self._mark_seen(ids, valid)
        first = self._select(self.target.lm_head(last)[:, None])[:, 0]
        if self.mode.penalty:
            self._mark_seen(first[:, None], torch.ones_like(first[:, None], dtype=torch.bool))
        self.root.copy_(first)
        self.out[:, 0] = first
        self.out_len.fill_(1)
        self.done.copy_(self._is_eos(first) | (self.max_new_t <= 1))

    def drafter_is_current(self) -> bool:
        """Whether the drafter still holds the state tensors this session was built on (another
        session's ``setup_cache`` replaces them; this session's graphs then must not run)."""
        now = _state_tensors(self.drafter)
        return all(now.get(name) is t for name, t in self._drafter_tensors.items())

    def remaining(self) -> int:
        """The most tokens a running request may still emit (0: every request is finished);
        one small device-to-host read, so it synchronises."""
        return int((self.max_new_t - self.out_len).masked_fill(self.done, 0).max())

    def tokens(self) -> tuple[torch.Tensor, list[int]]:
        """The emitted tokens (on the host, [R, max_new]) and each request's count, cut after
        its first EOS and at max_new_tokens: exactly where autoregressive generation stops."""
        max_new, eos = self._gen_max_new, self._gen_eos
        out = self.out[:, :max_new].cpu()
        count = []
        for r, n in enumerate(self.out_len.clamp(max=max_new).tolist()):
            if eos:
                hits = torch.isin(out[r, :n], torch.tensor(eos)).nonzero()
                n = int(hits[0, 0]) + 1 if hits.numel() else n
            count.append(n)
        return out, count

    def take_counterfactuals(self) -> dict[int, tuple[float, float, float]]:
        """The accumulated (sum, count, sum of squares) of counterfactual accept lengths per
        budget; resets them."""
        sums, counts, squares = self.cf.tolist()
        self.cf.zero_()
        return {b: (s, c, q) for b, s, c, q in zip(self.budgets, sums, counts, squares)}


__all__ = ["GenerationSession", "PhaseTimer", "StepPlans", "PHASES", "MAX_EOS"]
