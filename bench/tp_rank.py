"""One tensor-parallel rank's program on one device: the model of a GLOBAL configuration, built on
the meta device, parallelised over a fake process group (``torch.testing``'s "fake" backend: every
collective returns at once and moves nothing), then materialised on the device with random weights.

The rank then holds exactly the shapes one rank of a real TP-N run holds (heads / N, expert width
/ N, vocabulary / N), and its compiled, captured steps hold the same collectives -- as no-ops -- so
timing it times the rank's own work (bench/bench_tensor_parallel.py).  Its tokens mean nothing: each
"all-reduce" leaves this rank's partial sums, each "all-gather" this rank's shard (copied into every
rank's slot, or by :func:`fake_gathers` where the fake group leaves them unwritten).
"""
from __future__ import annotations

import torch
from torch import nn

# The K2.5 / K2.6 DFlash drafter's shapes (docs/dflash.md: Kimi-K2.5-DFlash), block size 8 (L = 7);
# its hidden size, vocabulary and taps come from the target.
K26_DFLASH = {"num_hidden_layers": 6, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 18432, "block_size": 8, "rms_norm_eps": 1e-5}


def k2_global_config(layers: int) -> dict:
    """K2's ``config.json`` (hidden 7168, 64 heads, 384 INT4 routed experts of width 2048 top-8 + a
    shared expert, dense layer 0 of width 18432, vocabulary 163840) with ``layers`` decoder layers."""
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict

    return k2_config_dict({"num_hidden_layers": layers}, int4=True, small=False)


def fake_world(world: int, rank: int = 0, device_type: str = "cpu"):
    """Initialise the default process group as a fake one of ``world`` ranks (this process is
    ``rank``) and return a 1-D DeviceMesh over it.  ``torch.distributed.destroy_process_group()``
    when done."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return init_device_mesh(device_type, (world,))


def fake_gathers(tp, device) -> str:
    """Make ``tp``'s all-gathers return this rank's tensor in every rank's slot: ``"fake_pg"`` where
    the fake process group already copies it so (newer torch), else ``"emulated"`` (a concatenation
    of copies replaces the collective for this ``tp``; older fake groups leave the output unwritten,
    whose garbage token ids would index the embedding out of bounds, or lack the collective).  The
    all-reduces stay the fake group's (its no-op leaves this rank's partial sums)."""
    x = torch.arange(1, 5, dtype=torch.float32, device=device)
    try:
        if torch.equal(tp.all_gather(x, 0), x.repeat(tp.world)):
            return "fake_pg"
    except RuntimeError:  # a fake group without this collective
        pass
    tp.all_gather = lambda t, dim=0: torch.cat([t.contiguous()] * tp.world, dim)
    return "emulated"


def _materialize(module: nn.Module, device) -> None:
    """Every meta parameter and buffer of ``module`` -> an uninitialised tensor of the same shape
    and dtype on ``device`` (parameters without grad)."""
    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is not None and t.is_meta:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    store[name] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new


def rank_target(config: dict, mesh, device, *, seed: int = 0):
    """This rank's shard of the K2 model of ``config`` (a ``config.json`` dict, global sizes), bf16,
    on ``device``: built on the meta device, parallelised over ``mesh``, then given random weights as
    bench_generate's k2_slice is (the model's own init; random INT4 routed experts where the config
    has a ``quantization_config``: bench_generate.random_int4_experts, k2_slice's own).  ``"meta"``:
    the parallelised model, nothing materialised."""
    from torch_kdtree.models.kimi_k2 import KimiK2Config, KimiK2Experts, KimiK2ForCausalLM
    from torch_kdtree.models.kimi_k2.checkpoint import empty_weights
    from torch_kdtree.models.parallel import parallelize

    from .bench_generate import random_int4_experts

    with empty_weights(torch.bfloat16):
        model = KimiK2ForCausalLM(KimiK2Config.from_dict(config))
    parallelize(model, mesh)
    if torch.device(device).type == "meta":  # shapes only: the routed experts stay dense [E, I / N, H]
        return model.eval()
    torch.manual_seed(seed)
    int4 = bool(config.get("quantization_config"))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, KimiK2Experts) and int4:
                random_int4_experts(m, device)  # before materialising: never the dense [E, I, H] stacks
        _materialize(model, device)
        for m in model.modules():
            model._init_weights(m)
    return model.to(device).eval()


def rank_drafter(target, mesh, device, *, seed: int = 1, **fields):
    """This rank's shard of a random DFlash drafter for ``target`` (``fields``: any DFlashConfig
    field at global size; hidden size, vocabulary and the number of target layers from the
    target), bf16 on ``device``: built on the meta device, parallelised over ``mesh``, weights as
    models/dflash/writer.random_drafter draws them (N(0, 1 / global fan-in); norms 1 + N(0, 0.1^2))."""
    from torch_kdtree.models.dflash import DFlashConfig, DFlashDraftModel
    from torch_kdtree.models.dflash.writer import TINY
    from torch_kdtree.models.parallel import parallelize

    c = target.config
    values = {**TINY, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_target_layers":
              c.num_hidden_layers, "mask_token_id": c.vocab_size - 2, **fields}
    model = DFlashDraftModel(DFlashConfig(**values), device="meta", dtype=torch.bfloat16)
    parallelize(model, mesh)
    if torch.device(device).type == "meta":
        return model.eval()
    _materialize(model, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
            else:
                fan_in = model.tp.global_shapes.get(name, tuple(p.shape))[1]
                p.copy_(torch.randn(p.shape, generator=gen, device=device) / fan_in ** 0.5)
    return model.to(device).eval()


__all__ = ["K26_DFLASH", "k2_global_config", "fake_world", "fake_gathers", "rank_target", "rank_drafter"]
