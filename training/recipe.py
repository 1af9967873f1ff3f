"""The recipe: every size, step count and rate of one pipeline run, in one dataclass, at two scales.

:data:`FULL` is sized for one H200 within about ten minutes and for a shipped pair of at most
25 MB (``run.py``'s docstring has the time estimate; :func:`checkpoint_bytes` the size);
:data:`TOY` runs the same code on a CPU in seconds (tests/test_training.py).

The target keeps what makes it Kimi K2 at any size: MLA with K2's 512 + 64 latent row (what the
MLA kernels read), at least 8 heads, a dense layer 0 then MoE layers with one shared expert,
``noaux_tc`` sigmoid routing with the aux-free bias, YaRN RoPE, untied embeddings, and routed
experts of sizes ``int4_moe`` tiles (hidden a multiple of 128, expert width of 64).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

# K2's rope: theta 50000, YaRN with mscale = mscale_all_dim = 1 (amplitude 1); the window here is
# the training window, the factor stretches it 4x.
_YARN = {"type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _target(**sizes) -> dict:
    """K2 config.json overrides: the routing, norm and rope fields of K2, then ``sizes``."""
    window = sizes.pop("window")
    base = {
        "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "tie_word_embeddings": False,
        "initializer_range": 0.02, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {**_YARN, "original_max_position_embeddings": window},
        "max_position_embeddings": int(window * _YARN["factor"]),
    }
    base.update(sizes)
    base["num_key_value_heads"] = base["num_attention_heads"]
    return base


@dataclass
class Recipe:
    name: str
    # corpus and tokenizer
    corpus_bytes: int | None          # None: the whole standard library; else a fixed subset of about this size
    packages: tuple                   # installed packages whose sources join the corpus (licences checked)
    package_bytes: int | None         # about this many bytes of them (a fixed subset by path hash); None: all
    heldout_fraction: float
    vocab_size: int
    # target pre-training (bf16 autocast on CUDA, fp32 on the CPU)
    target: dict                      # K2 config.json overrides (vocab_size is the tokenizer's)
    seq_len: int
    batch_size: int
    steps: int
    minutes: float                    # wall-clock cap: the schedule follows max(step / steps, time / cap)
    lr: float
    warmup_steps: int
    weight_decay: float
    bias_update_speed: float          # aux-free balancing: bias += speed * sign(mean load - load) per step
    # quantisation-aware training of the routed experts (fake INT4, straight-through), then export
    qat_steps: int
    qat_minutes: float
    qat_lr: float
    # drafter (DFlash): data from the INT4 target's own continuations
    drafter: dict                     # DFlashConfig fields (hidden size, vocabulary, mask token: the target's)
    prompt_len: int
    continuation_len: int
    continuations: int
    greedy_fraction: float            # the rest sampled at temperature 1
    generate_batch: int               # requests per generate call
    drafter_batch: int
    anchors: int                      # random anchors (blocks) per sequence per step
    drafter_steps: int
    drafter_minutes: float
    drafter_lr: float
    loss_decay_gamma: float           # depth-k loss weight exp(-(k - 1) / gamma) (DFlash: 4 for block size 8)
    # held-out evaluation
    eval_tokens: int | None           # held-out tokens scored (None: all)
    eval_batch: int
    eval_continuations: int           # held-out prompts for the drafter's agreement
    check_prompts: int                # held-out prompts for the DDTree == AR check
    check_new_tokens: int
    check_budget: int
    # the acceptance sweep (on the check prompts, check_new_tokens each): greedy at these budgets, sampled at
    # check_budget
    sweep_budgets: tuple = (4, 8, 16, 32, 64)
    log_every: int = 50
    notes: list[str] = field(default_factory=list)

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)


FULL = Recipe(
    name="full",
    corpus_bytes=None, heldout_fraction=0.03, vocab_size=4096,
    # the stdlib alone was 8.1 MB on the device (no test package): with ~64 MB of the packages torch
    # installs, pre-training reads the corpus about once instead of ~7 times (training/corpus.py)
    packages=("torch", "transformers", "numpy", "sympy", "networkx", "triton", "jinja2", "fsspec", "huggingface_hub",
              "setuptools"),
    package_bytes=64_000_000,
    target=_target(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=5,
                   num_attention_heads=8, q_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=32,
                   num_experts_per_tok=4, window=512),
    # run 195 (H200, grouped_padded experts, 585 k tokens/s): 8,000 steps in 7.5 min reached 0.83 bits/byte
    # held out but left the drafter 27 s (0.65 depth-1 agreement, its loss still falling fast); 4,600 steps
    # (~4.3 min there; the time cap binds on slower cards) leave the drafter 2.75 min within ten minutes
    seq_len=512, batch_size=64, steps=4600, minutes=4.5, lr=3e-3, warmup_steps=100, weight_decay=0.1,
    bias_update_speed=1e-3,
    qat_steps=300, qat_minutes=0.75, qat_lr=3e-4,
    drafter=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768,
                 block_size=8, target_layer_ids=[1, 2, 3, 4], rms_norm_eps=1e-5),
    # 64 + 448 = the target's 512-token training window: run 174's drafter (64 + 192) followed the
    # target to ~300 tokens of context and fell to 1.3-2.3 accepted tokens a step beyond (diagnose)
    # 8,192 continuations (3.7 M tokens, ~25 s; their taps 8.6 GB in bf16).  64 anchors a sequence: run
    # 195's drafter step (32 anchors, 17.8 ms) ran the H200 at ~22 TFLOP/s by a FLOP count, so more blocks per step
    # should cost little time; 9,000 steps would see each (sequence, anchor) pair ~10 times
    prompt_len=64, continuation_len=448, continuations=8192, greedy_fraction=0.5, generate_batch=256,
    drafter_batch=64, anchors=64, drafter_steps=9000, drafter_minutes=2.75, drafter_lr=2e-3, loss_decay_gamma=4.0,
    eval_tokens=None, eval_batch=32, eval_continuations=64, check_prompts=8, check_new_tokens=256, check_budget=16,
)

TOY = Recipe(
    name="toy",
    corpus_bytes=300_000, packages=(), package_bytes=None, heldout_fraction=0.1, vocab_size=512,
    target=_target(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=8, q_lora_rank=64, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                   num_experts_per_tok=2, window=128),
    seq_len=64, batch_size=8, steps=30, minutes=5.0, lr=1e-2, warmup_steps=5, weight_decay=0.1,
    bias_update_speed=1e-2,
    qat_steps=6, qat_minutes=1.0, qat_lr=1e-3,
    drafter=dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                 block_size=8, target_layer_ids=[0, 1], rms_norm_eps=1e-5),
    prompt_len=16, continuation_len=24, continuations=8, greedy_fraction=0.5, generate_batch=8,
    drafter_batch=8, anchors=8, drafter_steps=20, drafter_minutes=1.0, drafter_lr=5e-3, loss_decay_gamma=4.0,
    eval_tokens=4096, eval_batch=16, eval_continuations=4, check_prompts=2, check_new_tokens=16, check_budget=8,
    sweep_budgets=(4, 8), log_every=10,
)

RECIPES = {"full": FULL, "toy": TOY}


def drafter_config_fields(recipe: Recipe, vocab_size: int, mask_token_id: int) -> dict:
    """:class:`DFlashConfig` fields of the recipe's drafter for a target of the recipe's sizes: the
    target's hidden size, vocabulary, layer count and RoPE (theta and YaRN)."""
    t = recipe.target
    rope = {k: v for k, v in t["rope_scaling"].items() if k != "type"}
    return {**recipe.drafter, "hidden_size": t["hidden_size"], "vocab_size": vocab_size,
            "mask_token_id": mask_token_id, "num_target_layers": t["num_hidden_layers"],
            "max_position_embeddings": t["max_position_embeddings"],
            "rope_parameters": {"rope_type": "yarn", "rope_theta": t["rope_theta"], **rope}, "dtype": "bfloat16"}


def parameter_counts(recipe: Recipe) -> dict[str, int]:
    """Parameters of the recipe's target by kind (routed experts, the rest) and of its drafter."""
    t, vocab = recipe.target, recipe.vocab_size
    H, heads = t["hidden_size"], t["num_attention_heads"]
    qk = t["qk_nope_head_dim"] + t["qk_rope_head_dim"]
    q = H * t["q_lora_rank"] + t["q_lora_rank"] + t["q_lora_rank"] * heads * qk if t.get("q_lora_rank") \
        else H * heads * qk
    attention = (q + H * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) + t["kv_lora_rank"]
                 + t["kv_lora_rank"] * heads * (t["qk_nope_head_dim"] + t["v_head_dim"]) + heads * t["v_head_dim"] * H)
    layers, dense = t["num_hidden_layers"], t["first_k_dense_replace"]
    E, I = t["n_routed_experts"], t["moe_intermediate_size"]
    moe_layers = layers - dense
    rest = (2 * vocab * H + H + layers * (attention + 2 * H) + dense * 3 * H * t["intermediate_size"]
            + moe_layers * (E * H + 3 * H * I * t["n_shared_experts"]))
    d = recipe.drafter
    dq, dkv = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
    draft_layer = 2 * H + H * dq + 2 * H * dkv + dq * H + 2 * d["head_dim"] + 3 * H * d["intermediate_size"]
    drafter = len(d["target_layer_ids"]) * H * H + 2 * H + d["num_hidden_layers"] * draft_layer
    return {"routed_experts": moe_layers * E * 3 * H * I, "target_other": rest, "drafter": drafter,
            "moe_layers": moe_layers}


def checkpoint_bytes(recipe: Recipe) -> dict[str, int]:
    """Bytes of the two shipped checkpoints' tensors: INT4 routed experts (half a byte per weight, a
    bf16 scale per 32 and an int32 [2] shape per projection), everything else bf16, the routing
    bias fp32 (safetensors headers and the tokenizer not counted)."""
    n = parameter_counts(recipe)
    t = recipe.target
    projections = n["moe_layers"] * t["n_routed_experts"] * 3
    experts = n["routed_experts"] // 2 + n["routed_experts"] // 32 * 2 + projections * 8
    target = experts + 2 * n["target_other"] + n["moe_layers"] * t["n_routed_experts"] * 4
    return {"target": target, "drafter": 2 * n["drafter"], "total": target + 2 * n["drafter"]}


def active_parameters(recipe: Recipe) -> int:
    """Parameters one token's forward multiplies by (its routed experts, not all of them)."""
    n = parameter_counts(recipe)
    t = recipe.target
    per_expert = 3 * t["hidden_size"] * t["moe_intermediate_size"]
    return n["target_other"] - recipe.vocab_size * t["hidden_size"] + \
        n["moe_layers"] * t["num_experts_per_tok"] * per_expert


def describe(recipe: Recipe) -> str:
    n, b = parameter_counts(recipe), checkpoint_bytes(recipe)
    return (f"{recipe.name}: target {(n['routed_experts'] + n['target_other']) / 1e6:.2f} M parameters "
            f"({n['routed_experts'] / 1e6:.2f} M in routed experts, {active_parameters(recipe) / 1e6:.2f} M active "
            f"per token), drafter {n['drafter'] / 1e6:.2f} M; checkpoints {b['target'] / 1e6:.1f} MB + "
            f"{b['drafter'] / 1e6:.1f} MB = {b['total'] / 1e6:.1f} MB")


def lr_at(progress: float, peak: float, warmup: float, floor: float = 0.1) -> float:
    """Linear warm-up over the first ``warmup`` of progress, then cosine from ``peak`` to ``floor * peak``."""
    if progress < warmup:  # never above the peak: a warm-up shorter than 1e-3 of the schedule starts at it
        return peak * min(1.0, max(progress, 1e-3) / warmup)
    x = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x)))


__all__ = ["Recipe", "FULL", "TOY", "RECIPES", "drafter_config_fields", "parameter_counts", "checkpoint_bytes",
           "active_parameters", "describe", "lr_at"]
