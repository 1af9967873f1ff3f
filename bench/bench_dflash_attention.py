"""The DFlash drafter's draft call against its context length, with a long-context capacity:
attention over the live slots only (flash attention's variable-length segments, the default on
CUDA) against the masked SDPA over every slot of the cache (the form before, and the CPU's).

Run (H200, ~1 min):  pytest bench/bench_dflash_attention.py --benchmark-only -s
The drafter is bench_generate's k2_slice drafter (hidden 7168, 1 layer, 8 query heads, 1 KV head
of 128, intermediate 2304, block size 8; random bf16 weights) with a vocabulary-shard head of
20480 rows, one request, a cache of CAPACITY = 262,144 context tokens (what a 256k session sets
up).  Times are per draft call inside a CUDA graph (bench/conftest.py).  bytes = the live K/V rows
(context + block, 512 B a slot) + the drafter's weights and head; floor = bytes / the HBM ceiling
(max of a read-only stream and a device copy, both measured in this run).
"""
import pytest
import torch

from torch_kdtree.models.dflash import random_drafter
from torch_kdtree.ops import value_checks

from .bench_generate import BLOCK_SIZE as BLOCK, CONFIGS, DRAFTERS
from .conftest import cuda_time_us, hbm_ceiling, record, requires_cuda

CAPACITY = 262_144
HIDDEN, VOCAB = CONFIGS["k2_slice"]["hidden_size"], CONFIGS["k2_slice"]["vocab_size"]


def _drafter():
    d = random_drafter(seed=1, dtype=torch.float32, hidden_size=HIDDEN, vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                       num_target_layers=CONFIGS["k2_slice"]["num_hidden_layers"], block_size=BLOCK,
                       rms_norm_eps=1e-5, **DRAFTERS["k2_slice"])
    d = d.to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(2)
    embed = torch.randn(VOCAB, HIDDEN, device="cuda", generator=g).bfloat16()
    head = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5).bfloat16()
    d.bind_target(embed, head)
    d.setup_cache(1, CAPACITY)
    d.context_k.normal_(generator=g)
    d.context_v.normal_(generator=g)
    return d


@requires_cuda
@pytest.mark.parametrize("context", [1024, 16384, 131072, 262144 - BLOCK])
def test_draft_call_against_context(benchmark, context):
    d = _drafter()
    root = torch.tensor([5], device="cuda")
    d.context_lengths.fill_(context)
    weights = sum(p.numel() * p.element_size() for p in d.parameters()) + VOCAB * HIDDEN * 2
    times = {}
    with torch.no_grad(), value_checks(False):
        for live in (False, True):
            d.live_attention = live
            times[live] = cuda_time_us(lambda: d(root), calls_per_graph=5, replays=5)
        d.live_attention = None
        auto = d.live_attention_in_use()
        out_live = d(root) if auto else None
        d.live_attention = False
        out_masked = d(root)
    err = ((out_live.float() - out_masked.float()).norm() / out_masked.float().norm()).item() if auto else float("nan")
    ceiling = hbm_ceiling()
    kv_bytes = (context + BLOCK) * 2 * 128 * 2
    floor_us = (kv_bytes + weights) / (ceiling.gbs * 1e3)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    record(benchmark, op="dflash_draft", context=context, capacity=CAPACITY, masked_us=times[False],
           live_us=times[True], speedup=times[False] / times[True], live_floor_ratio=floor_us / times[True],
           default_is_live=auto, logits_rel_diff=err, kv_MB=kv_bytes / 1e6, weights_MB=weights / 1e6,
           **ceiling.fields())
