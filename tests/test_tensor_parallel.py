"""Tensor parallelism on CPU: gloo worlds of 2, 4 and 8 spawned processes (tests/tp_worker.py).

What must hold on every rank: logits gathered from the tensor-parallel model equal the single-process
model's (fp32, relative error <= 1e-5); greedy DDTree (a sharded DFlash drafter) and greedy
autoregressive tokens equal the single-process tokens; hidden states are bitwise equal across ranks;
a rank loading a checkpoint reads only its slices; the vocabulary-parallel argmax, Gumbel-max
sampling and draft top-K equal the unsharded results (ties at shard boundaries included); the
compiled step (fullgraph) holds two all-reduces per layer; the auto budget planner's choices are
equal on every rank.  Bad setups fail with errors that say what does not divide.
"""
import json
import math
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

import tp_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    from torch_kdtree.models.kimi_k2.writer import write_random_checkpoint

    path = tmp_path_factory.mktemp("tp_int4")
    write_random_checkpoint(path, dict(tp_worker.INT4_TARGET), int4=True, num_shards=3, seed=5)
    return str(path)


def _spawn(world: int, names: list, tmp_path, checkpoint=None) -> list[dict]:
    mp.spawn(tp_worker.run, args=(world, _free_port(), str(tmp_path), names, checkpoint), nprocs=world, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, rep in enumerate(reports):
        for name, scenario in rep.items():
            assert "error" not in scenario, f"rank {r} of {world}, {name}:\n{scenario['error']}"
    return reports


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tensor_parallel_model_equals_the_single_process_model(world, tmp_path, int4_checkpoint):
    reports = _spawn(world, ["forward", "generate", "int4_load", "token_choice"], tmp_path, int4_checkpoint)
    for r, rep in enumerate(reports):
        fwd, gen, load, choice = rep["forward"], rep["generate"], rep["int4_load"], rep["token_choice"]
        assert fwd["prefill_rel_err"] <= 1e-5 and fwd["tree_rel_err"] <= 1e-5, (r, fwd)
        assert fwd["compiled_all_reduces"] == [2 * fwd["layers"]], (r, fwd["compiled_all_reduces"])
        assert fwd["dtensor_equal"] and fwd["dtensor_placements"] == ["S(0)", "S(1)", "S(0)", "S(2)", "R"], (r, fwd)
        assert "all_reduce" in fwd["plan"]
        assert gen["ar_equal"] and gen["dd_equal"] and gen["auto_equal"] and gen["dd_equals_ar"], (r, gen)
        assert gen["drafter_load_equal"] and gen["fp8_equal"] and gen["compiled_dd_equal"], (r, gen)
        assert load["int4"] and load["ar_equal"] and load["dd_equal"] and load["logits_rel_err"] <= 1e-5, (r, load)
        assert choice["argmax_equal"] and choice["sample_equal_plain"] and choice["sample_equal_filtered"], (r, choice)
        assert choice["topk_ids_equal"] and choice["topk_lp_err"] <= 1e-5, (r, choice)
    # the same hidden states (bitwise) and budget choices on every rank
    assert len({rep["forward"]["hidden_digest"] for rep in reports}) == 1
    assert len({tuple(rep["generate"]["auto_budgets"]) for rep in reports}) == 1
    # each rank read exactly its slices: 1/world of every sharded tensor, the replicated ones whole
    want = _elements_per_rank(int4_checkpoint, world)
    assert [rep["int4_load"]["elements_read"] for rep in reports] == [want] * world
    whole = set(reports[0]["int4_load"]["whole_tensors"])
    assert whole and not any(_sharded(n) for n in whole), sorted(n for n in whole if _sharded(n))


_SHARDED = re.compile(r"(experts\.\d+\.(gate|up|down)_proj\.(weight|weight_packed|weight_scale)"
                      r"|self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\.weight"
                      r"|mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight|^lm_head\.weight)$")


def _sharded(name: str) -> bool:
    """Checkpoint tensors a tensor-parallel rank reads a slice of (docs/parallel.md's placement)."""
    return bool(_SHARDED.search(name))


def _elements_per_rank(checkpoint: str, world: int) -> int:
    total = 0
    for f in Path(checkpoint).glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for name in h.keys():
                n = math.prod(h.get_slice(name).get_shape())
                total += n // world if _sharded(name) else n
    return total


@pytest.fixture
def fake_world(request):
    """A real DeviceMesh over a fake process group (no peers, no collectives): for what happens on
    one rank before any collective runs (placement checks, loading)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(world: int, rank: int = 0):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        return init_device_mesh("cpu", (world,))

    yield make
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world,overrides,what", [
    (3, {}, "num_attention_heads = 8 does not divide by 3"),
    (4, {"moe_intermediate_size": 30}, "moe_intermediate_size = 30 does not divide by 4"),
    (2, {"vocab_size": 129}, "vocab_size = 129 does not divide by 2"),
    (2, {"intermediate_size": 97}, "intermediate_size (dense MLP) = 97 does not divide by 2"),
])
def test_a_world_that_does_not_divide_the_model_is_refused(world, overrides, what, fake_world):
    from torch_kdtree.models.generation.tiny import tiny_target
    from torch_kdtree.models.parallel import ParallelConfigError, parallelize

    model = tiny_target(1, **tp_worker.HEADS, **overrides)
    with pytest.raises(ParallelConfigError, match=re.escape(what)):
        parallelize(model, fake_world(world))


def test_int4_experts_must_keep_whole_scale_groups_per_rank(fake_world, tmp_path):
    from torch_kdtree.models import KimiK2ForCausalLM
    from torch_kdtree.models.kimi_k2.writer import write_random_checkpoint
    from torch_kdtree.models.parallel import ParallelConfigError

    write_random_checkpoint(tmp_path, {**tp_worker.INT4_TARGET, "moe_intermediate_size": 64}, int4=True)
    with pytest.raises(ParallelConfigError, match=r"moe_intermediate_size \(INT4 scale groups\) = 64 does not "
                                                  r"divide by 4 in units of 32"):
        KimiK2ForCausalLM.from_pretrained(tmp_path, device_mesh=fake_world(4), progress=False)


def test_target_and_drafter_on_different_meshes_are_refused(fake_world):
    from torch_kdtree.models.generation import GenerationSession
    from torch_kdtree.models.generation.tiny import tiny_target
    from torch_kdtree.models.parallel import parallelize

    target = tiny_target(2, **tp_worker.HEADS)
    drafter = tp_worker.drafter_for(target, 2)
    parallelize(target, fake_world(2))  # the drafter stays whole
    with pytest.raises(ValueError, match=r"drafter is parallelised over a single device but the target over cpu "
                                         r"ranks \[0, 1\]"):
        GenerationSession(target, drafter, batch_size=1, max_prompt=16, max_new=8, budgets=(0, 4))


def test_a_rank_missing_a_checkpoint_shard_names_it(fake_world, int4_checkpoint, tmp_path):
    import shutil

    from torch_kdtree.models import KimiK2ForCausalLM
    from torch_kdtree.models.kimi_k2.checkpoint_files import CheckpointError

    copy_dir = tmp_path / "ckpt"
    shutil.copytree(int4_checkpoint, copy_dir)
    shard = sorted(copy_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=re.escape(shard.name)):
        KimiK2ForCausalLM.from_pretrained(copy_dir, device_mesh=fake_world(2, rank=1), progress=False)
