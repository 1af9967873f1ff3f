"""Kimi K2.x checkpoints: the writer's formats, the loader's streaming and its errors.

Format facts are checked against an independent unpacking written here and against the
``compressed-tensors`` package; the loader is exercised on a stand-in module tree with the
model's parameter names (``_NamedModel``) and on the real ``KimiK2ForCausalLM``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import torch_kdtree  # noqa: F401  (mounts torch_kdtree.models)
from conftest import requires_cuda
from torch_kdtree.models.kimi_k2 import checkpoint as ckpt_mod
from torch_kdtree.models.kimi_k2.checkpoint import (CheckpointError, MissingShardError, load_checkpoint,
                                                    parse_quantization_config)
from torch_kdtree.models.kimi_k2.writer import (K2_QUANTIZATION_CONFIG, _tensor_specs, compressed_tensors_layout, pack_int4,
                                                unpack_int4, write_random_checkpoint)

# --------------------------------------------------------------------------- independent helpers


def unpack_int4_explicit(packed: torch.Tensor, shape) -> torch.Tensor:
    """The format as docs/kimi_k2.md writes it, element by element along k: nibble k % 8 of word k // 8, minus 8."""
    out_f, in_f = shape
    q = torch.empty(out_f, in_f, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    for k in range(in_f):
        q[:, k] = ((words[:, k // 8] >> (4 * (k % 8))) & 0xF) - 8
    return q


def dequantize_explicit(packed, scale, shape) -> torch.Tensor:
    q = unpack_int4_explicit(packed, shape).to(torch.float32)
    return q * scale.to(torch.float32).repeat_interleave(32, dim=-1)


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# --------------------------------------------------------------------------- a stand-in model tree


class _Experts(torch.nn.Module):
    """Routed experts with the model's setter interface; keeps what it was handed."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def set_dense(self, gate, up, down):
        self.calls += 1
        self.mode, self.tensors = "dense", (gate, up, down)

    def set_int4(self, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale):
        self.calls += 1
        self.mode, self.tensors = "int4", (gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)


class _NamedModel(torch.nn.Module):
    """Parameters named and shaped as KimiK2ForCausalLM's, routed experts behind the setters."""

    def __init__(self, config: dict):
        super().__init__()
        from types import SimpleNamespace
        self.config = SimpleNamespace(**config)
        for name, shape, kind in _tensor_specs(config, int4=False):
            if ".mlp.experts." in name:
                owner = name.split(".mlp.experts.")[0] + ".mlp.experts"
                if not _has(self, owner):
                    _module(self, owner.rsplit(".", 1)[0]).add_module("experts", _Experts())
                continue
            owner, _, leaf = name.rpartition(".")
            mod = _module(self, owner)
            if kind == "bias":
                mod.register_buffer(leaf, torch.zeros(shape, dtype=torch.float32))
            else:
                mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
        self.register_buffer("rope_table", torch.arange(4.0), persistent=False)


def _has(model, name):
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def _module(model, dotted):
    mod = model
    for part in dotted.split(".") if dotted else []:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    return mod


def _empty_model(config: dict) -> _NamedModel:
    with ckpt_mod.empty_weights():
        return _NamedModel(config)


def _text_config(directory: Path) -> dict:
    raw = json.loads((directory / "config.json").read_text())
    return raw.get("text_config", raw)


# --------------------------------------------------------------------------- writer: formats


def test_int4_packing_matches_the_format_definition_and_compressed_tensors():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-8, 8, (48, 128), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (48, 16)
    assert torch.equal(unpack_int4_explicit(packed, q.shape), q.to(torch.int64))
    assert torch.equal(packed, ct.pack_to_int32(q, 4))
    assert torch.equal(ct.unpack_from_int32(packed, 4, torch.Size(q.shape)), q)
    assert torch.equal(unpack_int4(packed), q)
    # lowest nibble first, stored as q + 8: [-8, -7, ..., -1] -> nibbles 0..7 -> 0x76543210
    assert pack_int4(torch.arange(-8, 0, dtype=torch.int8)[None]).item() == 0x76543210


def test_written_config_is_the_k2_thinking_layout(tmp_path):
    written = write_random_checkpoint(tmp_path, int4=True, num_shards=3)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk == written
    assert on_disk["model_type"] == "kimi_k2" and on_disk["architectures"] == ["DeepseekV3ForCausalLM"]
    assert on_disk["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    assert on_disk["rope_scaling"]["type"] == "yarn" and on_disk["rope_scaling"]["factor"] == 64.0
    assert (on_disk["topk_method"], on_disk["scoring_func"]) == ("noaux_tc", "sigmoid")
    qc = on_disk["quantization_config"]
    assert qc == K2_QUANTIZATION_CONFIG
    assert parse_quantization_config(qc).group_size == 32
    assert "quantization_config" not in write_random_checkpoint(tmp_path / "bf16", int4=False)


def test_shards_follow_the_k2_naming_and_the_index_covers_every_tensor(tmp_path):
    write_random_checkpoint(tmp_path, int4=True, num_shards=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-000003.safetensors" for i in (1, 2, 3)]
    tensors = {}
    for f in files:
        with safe_open(str(tmp_path / f), "pt") as h:
            tensors.update({k: f for k in h.keys()})
    assert tensors == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read_all(tmp_path).values())
    # the byte-balanced split puts some layer's experts in two shards (the loader must stack across shards)
    layer_files = {}
    for name, f in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", name)
        if m:
            layer_files.setdefault(m.group(1), set()).add(f)
    assert any(len(fs) > 1 for fs in layer_files.values())


def test_int4_expert_tensors_have_the_compressed_tensors_names_shapes_and_dtypes(tmp_path):
    config = write_random_checkpoint(tmp_path, int4=True, num_shards=2)
    t = read_all(tmp_path)
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    base = "model.layers.1.mlp.experts.5."
    assert t[base + "gate_proj.weight_packed"].dtype == torch.int32
    assert t[base + "gate_proj.weight_packed"].shape == (i, h // 8)
    assert t[base + "gate_proj.weight_scale"].dtype == torch.bfloat16
    assert t[base + "gate_proj.weight_scale"].shape == (i, h // 32)
    assert t[base + "down_proj.weight_packed"].shape == (h, i // 8)
    assert t[base + "down_proj.weight_scale"].shape == (h, i // 32)
    assert t[base + "down_proj.weight_shape"].tolist() == [h, i]
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.1.mlp.shared_experts.up_proj.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in t)   # layer 0 is dense
    assert not any(k.endswith("weight_packed") and ".experts." not in k for k in t)


def test_tensor_values_depend_on_seed_and_name_not_on_sharding(tmp_path):
    write_random_checkpoint(tmp_path / "a", num_shards=1, seed=3)
    write_random_checkpoint(tmp_path / "b", num_shards=4, seed=3)
    write_random_checkpoint(tmp_path / "c", num_shards=1, seed=4)
    a, b, c = (read_all(tmp_path / x) for x in "abc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert (tmp_path / "a" / "model.safetensors").is_file()
    assert not (tmp_path / "a" / "model.safetensors.index.json").exists()


def test_k25_wrapper_nests_the_text_config_and_prefixes_tensor_names(tmp_path):
    written = write_random_checkpoint(tmp_path, int4=True, num_shards=2, k25_wrapper=True)
    assert written["model_type"] == "kimi_k25"
    assert written["architectures"] == ["KimiK25ForConditionalGeneration"]
    text = written["text_config"]
    assert text["model_type"] == "kimi_k2" and "quantization_config" not in written
    assert text["quantization_config"]["format"] == "pack-quantized"
    names = read_all(tmp_path).keys()
    text_names = [n for n in names if n.startswith("language_model.")]
    others = sorted(set(names) - set(text_names))
    assert others and all(n.startswith(("vision_tower.", "mm_projector.")) for n in others)
    assert "language_model.lm_head.weight" in names
    assert "language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed" in names


def test_writer_takes_a_kimi_config_and_writes_it_back_in_the_k2_layout(tmp_path):
    from torch_kdtree.models.kimi_k2 import KimiK2Config
    from torch_kdtree.models.kimi_k2.writer import k2_config_dict
    config = KimiK2Config.from_dict(k2_config_dict({"num_hidden_layers": 2, "n_routed_experts": 4, "rope_theta": 1e4}))
    written = write_random_checkpoint(tmp_path, config, int4=False, num_shards=1)
    assert (written["num_hidden_layers"], written["n_routed_experts"], written["rope_theta"]) == (2, 4, 1e4)
    assert written["rope_scaling"]["type"] == "yarn" and written["torch_dtype"] == "bfloat16"
    assert "quantization_config" not in written and written["model_type"] == "kimi_k2"
    reread = KimiK2Config.from_pretrained(tmp_path)
    assert reread.num_hidden_layers == 2 and reread.rope_parameters["factor"] == 64.0


# --------------------------------------------------------------------------- quantization_config parsing


@pytest.mark.parametrize("path, value, named", [
    (("quant_method",), "fp8", "quant_method"),
    (("format",), "int-quantized", "format"),
    (("format",), "nvfp4-pack-quantized", "format"),
    (("quantization_status",), "frozen", "quantization_status"),
    (("config_groups", "group_0", "weights", "num_bits"), 8, "num_bits"),
    (("config_groups", "group_0", "weights", "group_size"), 128, "group_size"),
    (("config_groups", "group_0", "weights", "symmetric"), False, "symmetric"),
    (("config_groups", "group_0", "weights", "strategy"), "channel", "strategy"),
    (("config_groups", "group_0", "weights", "type"), "float", "type"),
    (("config_groups", "group_0", "weights", "actorder"), "group", "actorder"),
    (("config_groups", "group_0", "input_activations"), {"num_bits": 8}, "input_activations"),
])
def test_unsupported_quantisation_is_refused_by_name(path, value, named):
    import copy
    qc = copy.deepcopy(K2_QUANTIZATION_CONFIG)
    node = qc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(CheckpointError, match=re.escape(named) + r".*" + re.escape(repr(value))):
        parse_quantization_config(qc)


def test_no_quantization_config_means_bf16():
    assert parse_quantization_config(None) is None


# --------------------------------------------------------------------------- loader on the stand-in tree


def _check_loaded(model: _NamedModel, directory: Path, dtype: torch.dtype, int4: bool, prefix: str = ""):
    """Every parameter equals its checkpoint tensor (cast to dtype); experts stacked in expert order."""
    stored = read_all(directory)
    config = _text_config(directory)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "rope_table":
            continue
        t = stored[prefix + name]
        want = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        assert p.dtype == want, name
        assert torch.equal(p, t.to(want)), name
    layers = [i for i in range(config["num_hidden_layers"]) if i >= config["first_k_dense_replace"]]
    for i in layers:
        experts = model.get_submodule(f"model.layers.{i}.mlp.experts")
        assert experts.calls == 1 and experts.mode == ("int4" if int4 else "dense")
        base = f"{prefix}model.layers.{i}.mlp.experts"
        for e in range(config["n_routed_experts"]):
            for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
                if int4:
                    packed, scale = experts.tensors[2 * j][e], experts.tensors[2 * j + 1][e]
                    assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16
                    assert torch.equal(packed, stored[f"{base}.{e}.{proj}.weight_packed"])
                    assert torch.equal(scale, stored[f"{base}.{e}.{proj}.weight_scale"])
                else:
                    w = experts.tensors[j][e]
                    assert w.dtype == dtype
                    assert torch.equal(w, stored[f"{base}.{e}.{proj}.weight"].to(dtype))


@pytest.mark.parametrize("int4", [True, False], ids=["int4", "bf16"])
def test_every_parameter_is_loaded_from_its_checkpoint_tensor(tmp_path, int4):
    write_random_checkpoint(tmp_path, int4=int4, num_shards=3, seed=11)
    model = _empty_model(_text_config(tmp_path))
    assert all(p.is_meta for p in model.parameters())       # built without allocating weights
    info = load_checkpoint(model, tmp_path, progress=False)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert info.unexpected == [] and len(info.loaded) == len(read_all(tmp_path))
    _check_loaded(model, tmp_path, torch.bfloat16, int4)


def test_requested_dtype_casts_everything_but_the_routing_bias(tmp_path):
    write_random_checkpoint(tmp_path, int4=False, num_shards=2, seed=5)
    model = _empty_model(_text_config(tmp_path))
    load_checkpoint(model, tmp_path, dtype=torch.float32, progress=False)
    _check_loaded(model, tmp_path, torch.float32, int4=False)


def test_k25_wrapper_loads_the_text_model_and_lists_the_vision_tensors(tmp_path):
    write_random_checkpoint(tmp_path, int4=True, num_shards=2, k25_wrapper=True, seed=2)
    model = _empty_model(_text_config(tmp_path))
    with pytest.warns(UserWarning, match=r"vision_tower\.patch_embed\.proj\.weight") as record:
        info = load_checkpoint(model, tmp_path, progress=False)
    assert "outside the 'language_model.' text model" in str(record[0].message)
    assert info.unexpected and all(n.startswith(("vision_tower.", "mm_projector.")) for n in info.unexpected)
    _check_loaded(model, tmp_path, torch.bfloat16, int4=True, prefix="language_model.")


def test_shards_are_opened_one_at_a_time_each_once(tmp_path, monkeypatch):
    write_random_checkpoint(tmp_path, int4=True, num_shards=4, seed=1)
    real_open = ckpt_mod.safe_open
    events = []

    class Tracked:
        open_now = 0

        def __init__(self, path, *a, **kw):
            self.path, self.inner = path, real_open(path, *a, **kw)

        def __enter__(self):
            Tracked.open_now += 1
            events.append(("open", Path(self.path).name, Tracked.open_now))
            self.handle = self.inner.__enter__()
            return self

        def get_tensor(self, name):
            events.append(("read", Path(self.path).name, name))
            return self.handle.get_tensor(name)

        def __exit__(self, *exc):
            Tracked.open_now -= 1
            events.append(("close", Path(self.path).name, Tracked.open_now))
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(ckpt_mod, "safe_open", Tracked)
    model = _empty_model(_text_config(tmp_path))
    load_checkpoint(model, tmp_path, progress=False)
    opens = [e for e in events if e[0] == "open"]
    assert [e[1] for e in opens] == [f"model-0000{i}-of-000004.safetensors" for i in range(1, 5)]
    assert max(e[2] for e in opens) == 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    current = None
    for kind, fname, what in events:   # every read happens while its own shard is the open one
        if kind == "open":
            current = fname
        elif kind == "close":
            current = None
        else:
            assert index[what] == fname == current


def test_experts_of_a_layer_spanning_shards_are_handed_over_once_complete(tmp_path, monkeypatch):
    write_random_checkpoint(tmp_path, int4=True, num_shards=3, seed=9)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    spanning = {m.group(1) for n in index if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", n))
                if len({f for k, f in index.items() if k.startswith(f"model.layers.{m.group(1)}.mlp.experts.")}) > 1}
    assert spanning
    seen_files = []
    real_open = ckpt_mod.safe_open
    monkeypatch.setattr(ckpt_mod, "safe_open", lambda p, *a, **k: (seen_files.append(Path(p).name), real_open(p, *a, **k))[1])
    model = _empty_model(_text_config(tmp_path))
    handed = []
    for layer in sorted(spanning):
        experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
        original = experts.set_int4

        def record(*tensors, _layer=layer, _orig=original):
            handed.append((_layer, list(seen_files)))
            _orig(*tensors)
        experts.set_int4 = record
    load_checkpoint(model, tmp_path, progress=False)
    for layer, files_so_far in handed:
        needed = {f for k, f in index.items() if k.startswith(f"model.layers.{layer}.mlp.experts.")}
        assert needed <= set(files_so_far)
    _check_loaded(model, tmp_path, torch.bfloat16, int4=True)


def test_bf16_experts_are_plain_weights(tmp_path):
    write_random_checkpoint(tmp_path, int4=False, num_shards=1)
    t = read_all(tmp_path)
    assert t["model.layers.2.mlp.experts.15.down_proj.weight"].dtype == torch.bfloat16
    assert not any(k.endswith(("weight_packed", "weight_scale", "weight_shape")) for k in t)


# --------------------------------------------------------------------------- bad checkpoints


@pytest.fixture
def int4_dir(tmp_path):
    write_random_checkpoint(tmp_path, int4=True, num_shards=3, seed=7)
    return tmp_path


def _load(directory):
    return load_checkpoint(_empty_model(_text_config(directory)), directory, progress=False)


def _rewrite(directory: Path, name: str, change):
    """Replace tensor ``name`` in its shard by ``change(tensor)`` (None drops it)."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / index["weight_map"][name]
    tensors = load_file(str(shard))
    new = change(tensors[name])
    if new is None:
        del tensors[name]
        del index["weight_map"][name]
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        tensors[name] = new.contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_missing_shard_file_is_named(int4_dir):
    (int4_dir / "model-00002-of-000003.safetensors").unlink()
    with pytest.raises(MissingShardError, match=r"missing shard.*model-00002-of-000003\.safetensors"):
        _load(int4_dir)


def test_directory_without_weights_says_what_it_looked_for(tmp_path):
    write_random_checkpoint(tmp_path, num_shards=1)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(MissingShardError, match=r"model\.safetensors\.index\.json nor model\.safetensors.*weights\.bin"):
        _load(tmp_path)


@pytest.mark.parametrize("cut", [100, 10_000, 3])
def test_truncated_shard_is_named(int4_dir, cut):
    shard = int4_dir / "model-00003-of-000003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) - cut] if cut > 10 else data[:cut])
    with pytest.raises(CheckpointError, match=r"model-00003-of-000003\.safetensors: truncated"):
        _load(int4_dir)


def test_corrupt_header_is_named(int4_dir):
    shard = int4_dir / "model-00001-of-000003.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\x00\xff\x13\x07"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-00001-of-000003\.safetensors: corrupt safetensors header"):
        _load(int4_dir)


def test_missing_tensor_is_named(int4_dir):
    _rewrite(int4_dir, "model.layers.1.self_attn.kv_b_proj.weight", lambda t: None)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        _load(int4_dir)


def test_missing_expert_tensor_is_named(int4_dir):
    _rewrite(int4_dir, "model.layers.2.mlp.experts.3.down_proj.weight_scale", lambda t: None)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight_scale"):
        _load(int4_dir)


def test_index_naming_a_tensor_its_shard_lacks_is_refused(int4_dir):
    index_path = int4_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-000003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"not found in the shard the index names: model\.norm\.weight"):
        _load(int4_dir)


@pytest.mark.parametrize("name, change, message", [
    ("model.layers.1.mlp.experts.2.gate_proj.weight_packed", lambda t: t.to(torch.int64),
     r"wrong dtype for model\.layers\.1\.mlp\.experts\.2\.gate_proj\.weight_packed.*int64, expected int32"),
    ("model.layers.1.mlp.experts.2.up_proj.weight_scale", lambda t: t.to(torch.float16),
     r"wrong dtype for model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight_scale.*float16, expected bfloat16"),
    ("model.layers.0.self_attn.o_proj.weight", lambda t: t.to(torch.int32),
     r"wrong dtype for model\.layers\.0\.self_attn\.o_proj\.weight.*int32"),
    ("model.layers.1.self_attn.q_b_proj.weight", lambda t: t[:-1],
     r"wrong shape for model\.layers\.1\.self_attn\.q_b_proj\.weight.*expected \[96, 32\]"),
    ("model.layers.2.mlp.experts.0.down_proj.weight_packed", lambda t: t[:, :4],
     r"wrong shape for model\.layers\.2\.mlp\.experts\.0\.down_proj\.weight_packed.*\[128, 4\], expected \[128, 8\]"),
    ("model.layers.2.mlp.experts.7.down_proj.weight_shape", lambda t: torch.tensor([128, 32], dtype=torch.int32),
     r"wrong value for model\.layers\.2\.mlp\.experts\.7\.down_proj\.weight_shape: \[128, 32\], expected \[128, 64\]"),
])
def test_wrong_dtype_shape_or_value_is_named(int4_dir, name, change, message):
    _rewrite(int4_dir, name, change)
    with pytest.raises(CheckpointError, match=message):
        _load(int4_dir)


def test_unknown_quantisation_format_in_config_is_named(int4_dir):
    config = json.loads((int4_dir / "config.json").read_text())
    config["quantization_config"]["format"] = "marlin-24"
    (int4_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"quantization_config\.format = 'marlin-24'"):
        _load(int4_dir)


def test_bf16_experts_under_an_int4_config_are_refused_with_a_hint(tmp_path):
    write_random_checkpoint(tmp_path, int4=False, num_shards=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = K2_QUANTIZATION_CONFIG
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_packed \(the checkpoint holds bf16 \.weight here"):
        _load(tmp_path)


def test_quantised_non_expert_layer_is_refused_with_a_hint(int4_dir):
    name = "model.layers.1.mlp.shared_experts.gate_proj"
    q = torch.randint(-8, 8, (64, 64), dtype=torch.int8)
    _rewrite(int4_dir, name + ".weight", lambda t: None)
    shard = int4_dir / "model-00001-of-000003.safetensors"
    tensors = load_file(str(shard))
    tensors[name + ".weight_packed"] = pack_int4(q)
    save_file(tensors, str(shard))
    index_path = int4_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name + ".weight_packed"] = shard.name
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(name) + r"\.weight \(the checkpoint has it quantised"):
        _load(int4_dir)


def test_a_model_tensor_without_checkpoint_counterpart_is_never_left_uninitialised(int4_dir):
    model = _empty_model(_text_config(int4_dir))
    model.model.register_parameter("extra", torch.nn.Parameter(torch.empty(3, device="meta")))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.extra"):
        load_checkpoint(model, int4_dir, progress=False)


# --------------------------------------------------------------------------- compressed-tensors as the writer


def _compressed_tensors_encoder():
    """Experts quantised and packed by the compressed-tensors package's own pack-quantized compressor."""
    pq = pytest.importorskip("compressed_tensors.compressors.pack_quantized.base")
    qz = pytest.importorskip("compressed_tensors.quantization")
    scheme = qz.QuantizationScheme(targets=["Linear"], weights=qz.QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))

    def encode(q, scale):
        # q * scale is exact in float32, so the compressor's round(w / scale) recovers q.
        weight = (q.float().unflatten(-1, (-1, 32)) * scale.float().unsqueeze(-1)).flatten(-2)
        out = pq.PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
        return {k: out[k] for k in ("weight_packed", "weight_scale", "weight_shape")}

    return encode, pq.PackedQuantizationCompressor, scheme


def test_default_int4_files_equal_explicit_packing_and_the_compressed_tensors_compressor(tmp_path):
    encode, _, _ = _compressed_tensors_encoder()
    for sub, encoder in (("fast", None), ("ours", compressed_tensors_layout), ("ct", encode)):
        write_random_checkpoint(tmp_path / sub, int4=True, num_shards=2, seed=8, int4_encoder=encoder)
    fast, ours, ct = (read_all(tmp_path / sub) for sub in ("fast", "ours", "ct"))
    assert fast.keys() == ours.keys() == ct.keys()
    for k in fast:
        assert torch.equal(fast[k], ours[k]), k
        if k.endswith("weight_shape"):   # the package stores the shape as int64
            assert ct[k].tolist() == fast[k].tolist(), k
        else:
            assert torch.equal(fast[k], ct[k]), k


def test_experts_packed_by_compressed_tensors_load_and_dequantise_identically(tmp_path):
    encode, compressor, scheme = _compressed_tensors_encoder()
    write_random_checkpoint(tmp_path, int4=True, num_shards=2, seed=21, int4_encoder=encode)
    stored = read_all(tmp_path)
    assert stored["model.layers.1.mlp.experts.0.gate_proj.weight_shape"].dtype == torch.int64  # the package's choice
    model = _empty_model(_text_config(tmp_path))
    load_checkpoint(model, tmp_path, progress=False)
    config = _text_config(tmp_path)
    for layer in (1, 2):
        experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
        for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            packed, scale = experts.tensors[2 * j], experts.tensors[2 * j + 1]
            for e in range(config["n_routed_experts"]):
                base = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
                parts = {k: stored[base + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
                ours = dequantize_explicit(packed[e], scale[e], stored[base + "weight_shape"].tolist())
                # the package dequantises in the scale's dtype (bf16 as stored), and exactly with fp32 scales
                reference = compressor.decompress(parts, scheme)["weight"]
                assert reference.dtype == torch.bfloat16 and torch.equal(ours.bfloat16(), reference), base
                exact = compressor.decompress({**parts, "weight_scale": parts["weight_scale"].float()}, scheme)
                assert torch.equal(ours, exact["weight"]), base


# --------------------------------------------------------------------------- the real model


def _kimi():
    from torch_kdtree.models import kimi_k2
    return kimi_k2


def _expected_experts(stored: dict, prefix: str, layer: int, num_experts: int, int4: bool):
    """(gate, up, down) stacked in fp32 from the checkpoint tensors, dequantised by the explicit unpacking."""
    out = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        rows = []
        for e in range(num_experts):
            base = f"{prefix}model.layers.{layer}.mlp.experts.{e}.{proj}."
            if int4:
                shape = stored[base + "weight_shape"].tolist()
                rows.append(dequantize_explicit(stored[base + "weight_packed"], stored[base + "weight_scale"], shape))
            else:
                rows.append(stored[base + "weight"].float())
        out.append(torch.stack(rows))
    return out


def _check_model_matches_files(model, directory: Path, dtype: torch.dtype, int4: bool, prefix: str = ""):
    stored = read_all(directory)
    config = _text_config(directory)
    fp32 = ("e_score_correction_bias",)
    experts_seen = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".mlp.experts." in name or name.endswith("rotary_emb.inv_freq"):
            continue
        want = torch.float32 if name.endswith(fp32) else dtype
        assert t.dtype == want and torch.equal(t, stored[prefix + name].to(want)), name
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
        assert experts.is_int4 == int4
        got = experts.dense_weights(torch.float32)
        want = _expected_experts(stored, prefix, layer, config["n_routed_experts"], int4)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), layer
        experts_seen += 1
    assert experts_seen == config["num_hidden_layers"] - config["first_k_dense_replace"]


@pytest.mark.parametrize("int4", [True, False], ids=["int4", "bf16"])
def test_from_pretrained_reproduces_every_written_tensor(tmp_path, int4):
    write_random_checkpoint(tmp_path, int4=int4, num_shards=3, seed=13)
    model = _kimi().KimiK2ForCausalLM.from_pretrained(tmp_path, progress=False)
    assert not model.training
    _check_model_matches_files(model, tmp_path, torch.bfloat16, int4)


def test_from_pretrained_in_fp32_loads_everything_in_fp32_and_runs(tmp_path):
    write_random_checkpoint(tmp_path, int4=True, num_shards=2, seed=17)
    model = _kimi().KimiK2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, progress=False)
    _check_model_matches_files(model, tmp_path, torch.float32, int4=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 6, model.config.vocab_size) and torch.isfinite(logits).all()


def test_from_pretrained_builds_on_meta_and_never_initialises_weights(tmp_path, monkeypatch):
    write_random_checkpoint(tmp_path, int4=True, num_shards=2, seed=1)
    state_at_load = {}
    real_load = ckpt_mod.load_checkpoint

    def spy(model, *a, **kw):
        state_at_load.update({n: p.is_meta for n, p in model.named_parameters()})
        state_at_load.update({n: b.is_meta for n, b in model.named_buffers()})
        return real_load(model, *a, **kw)

    monkeypatch.setattr(ckpt_mod, "load_checkpoint", spy)
    for fn in ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_"):
        real = getattr(torch.nn.init, fn)
        monkeypatch.setattr(torch.nn.init, fn, lambda t, *a, _real=real, **k: (
            pytest.fail("random init of a real tensor") if not t.is_meta else _real(t, *a, **k)))
    model = _kimi().KimiK2ForCausalLM.from_pretrained(tmp_path, progress=False)
    real_only = {n for n, meta in state_at_load.items() if not meta}
    computed = {f"{m}.{b}" if m else b for m, mod in model.named_modules() for b in mod._non_persistent_buffers_set}
    assert state_at_load and real_only == computed   # only tables computed in __init__ (RoPE), never stored
    _check_model_matches_files(model, tmp_path, torch.bfloat16, int4=True)


def test_k25_wrapper_loads_through_from_pretrained(tmp_path):
    write_random_checkpoint(tmp_path, int4=True, num_shards=3, k25_wrapper=True, seed=23)
    with pytest.warns(UserWarning, match=r"vision_tower"):
        model, info = _kimi().KimiK2ForCausalLM.from_pretrained(tmp_path, progress=False, output_loading_info=True)
    assert info.unexpected and all(n.startswith(("vision_tower.", "mm_projector.")) for n in info.unexpected)
    _check_model_matches_files(model, tmp_path, torch.bfloat16, int4=True, prefix="language_model.")


def test_auto_model_for_causal_lm_loads_without_trust_remote_code(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM
    write_random_checkpoint(tmp_path, int4=True, num_shards=2, seed=29)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), _kimi().KimiK2Config)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)
    assert type(model) is _kimi().KimiK2ForCausalLM
    _check_model_matches_files(model, tmp_path, torch.bfloat16, int4=True)
    fp32 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device_map="cpu", progress=False)
    assert fp32.model.embed_tokens.weight.dtype == torch.float32


def test_from_pretrained_refuses_what_it_cannot_honour(tmp_path):
    write_random_checkpoint(tmp_path, int4=True, num_shards=1)
    cls = _kimi().KimiK2ForCausalLM
    with pytest.raises(TypeError, match="quantization_config"):
        cls.from_pretrained(tmp_path, quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="device_map='auto'"):
        cls.from_pretrained(tmp_path, device_map="auto")
    with pytest.raises(MissingShardError, match="not a local checkpoint directory"):
        cls.from_pretrained(tmp_path / "absent")


def test_int4_experts_written_by_compressed_tensors_dequantise_to_its_reference(tmp_path):
    encode, compressor, scheme = _compressed_tensors_encoder()
    write_random_checkpoint(tmp_path, int4=True, num_shards=3, seed=31, int4_encoder=encode)
    model = _kimi().KimiK2ForCausalLM.from_pretrained(tmp_path, progress=False)
    stored = read_all(tmp_path)
    config = _text_config(tmp_path)
    for layer in (1, 2):
        got = model.get_submodule(f"model.layers.{layer}.mlp.experts").dense_weights(torch.float32)
        for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            for e in range(config["n_routed_experts"]):
                base = f"model.layers.{layer}.mlp.experts.{e}.{proj}."
                parts = {k: stored[base + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
                bf16 = compressor.decompress(parts, scheme)["weight"]
                exact = compressor.decompress({**parts, "weight_scale": parts["weight_scale"].float()}, scheme)
                assert torch.equal(got[j][e], exact["weight"]), base
                assert torch.equal(got[j][e].bfloat16(), bf16), base


def test_progress_bar_runs_over_the_shards(tmp_path, monkeypatch):
    write_random_checkpoint(tmp_path, int4=True, num_shards=3)
    bars = []

    def fake_tqdm(iterable, **kw):
        bars.append((list(iterable), kw))
        return bars[-1][0]

    monkeypatch.setattr(ckpt_mod, "tqdm", fake_tqdm)
    _kimi().KimiK2ForCausalLM.from_pretrained(tmp_path)
    (files, kw), = bars
    assert [Path(f).name for f in files] == [f"model-0000{i}-of-000003.safetensors" for i in (1, 2, 3)]
    assert kw["unit"] == "shard" and not kw["disable"]


@requires_cuda
@pytest.mark.parametrize("int4", [True, False], ids=["int4", "bf16"])
def test_from_pretrained_onto_cuda_reproduces_every_written_tensor(tmp_path, int4):
    write_random_checkpoint(tmp_path, int4=int4, num_shards=3, seed=37)
    model = _kimi().KimiK2ForCausalLM.from_pretrained(tmp_path, device="cuda", progress=False)
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.is_cuda for t in tensors)
    _check_model_matches_files(model.cpu(), tmp_path, torch.bfloat16, int4)
    model.cuda()
    ids = torch.randint(0, model.config.vocab_size, (1, 5), device="cuda")
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits.float()).all()
