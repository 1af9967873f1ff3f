"""Inputs refused at the API edge (``generate``, ``DFlashDraftModel.from_pretrained``) with an
error that names the argument or file, before anything runs deep inside the model or an op."""
import functools
import re

import pytest
import torch

from torch_kdtree.models import DFlashDraftModel
from torch_kdtree.models.generation.tiny import tiny_drafter, tiny_target
from torch_kdtree.models.kimi_k2.checkpoint_files import CheckpointError

VOCAB = 128  # tiny_target's


@functools.lru_cache(maxsize=None)
def target(**overrides):
    return tiny_target(0, **overrides)


def ids(R: int = 1, T: int = 5) -> torch.Tensor:
    return torch.randint(3, VOCAB, (R, T), generator=torch.Generator().manual_seed(R * 100 + T))


def generate(model, input_ids, **kwargs):
    return model.generate(input_ids, max_new_tokens=2, eos_token_id=None, **kwargs)


# ---- input_ids ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_non_integer_input_ids_are_refused(dtype):
    with pytest.raises(ValueError, match=re.escape(f"input_ids must hold integer token ids, got dtype {dtype}")):
        generate(target(), ids().to(dtype))


def test_input_ids_that_are_not_a_tensor_are_refused():
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor of token ids, got list"):
        generate(target(), [[5, 6, 7]])


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1])
def test_out_of_vocabulary_input_ids_are_refused(bad):
    x = ids(2, 6)
    x[1, 3] = bad
    with pytest.raises(ValueError, match=re.escape(f"input_ids holds token id {bad} (request 1), outside the "
                                                   f"target's vocabulary [0, {VOCAB})")):
        generate(target(), x)


def test_out_of_vocabulary_input_ids_under_the_mask_are_refused():
    x, mask = ids(2, 6), torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    x[0, 4] = VOCAB
    with pytest.raises(ValueError, match=r"input_ids holds token id 128 \(request 0\)"):
        generate(target(), x, attention_mask=mask)


def test_padding_outside_the_vocabulary_is_not_a_prompt_token():
    """Only tokens under the attention mask are prompt tokens: a -1 in the padding is accepted."""
    x, mask = ids(2, 6), torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    padded = x.clone()
    padded[0, :2] = -1
    assert torch.equal(generate(target(), padded, attention_mask=mask)[:, 6:],
                       generate(target(), x, attention_mask=mask)[:, 6:])


# ---- a drafter that does not fit the target ----

def test_drafter_of_another_hidden_size_is_refused():
    drafter = tiny_drafter(target(hidden_size=96))
    with pytest.raises(ValueError, match="the drafter's hidden_size 96 != the target's hidden_size 64"):
        generate(target(), ids(), drafter=drafter, tree_budget=4)


def test_drafter_of_another_vocabulary_is_refused():
    drafter = tiny_drafter(target(vocab_size=256))
    with pytest.raises(ValueError, match="the drafter's vocab_size 256 != the target's vocab_size 128"):
        generate(target(), ids(), drafter=drafter, tree_budget=4)


def test_drafter_tapping_layers_the_target_lacks_is_refused():
    drafter = tiny_drafter(target(num_hidden_layers=3))
    with pytest.raises(ValueError, match=re.escape("the drafter's target_layer_ids [0, 1, 2] are not all layers of "
                                                   "the target (num_hidden_layers 2)")):
        generate(target(), ids(), drafter=drafter, tree_budget=4)


def test_drafter_of_another_dtype_is_refused():
    drafter = tiny_drafter(target()).to(torch.float64)
    with pytest.raises(ValueError, match="the drafter's dtype torch.float64 != the target's dtype torch.float32"):
        generate(target(), ids(), drafter=drafter, tree_budget=4)


def test_drafter_on_another_device_is_refused():
    drafter = tiny_drafter(target()).to("meta")
    with pytest.raises(ValueError, match="the drafter's device meta != the target's device cpu"):
        generate(target(), ids(), drafter=drafter, tree_budget=4)


def test_oracle_with_a_mismatched_inner_drafter_is_refused():
    from torch_kdtree.models.generation import OracleDrafter

    oracle = OracleDrafter(target(), inner=tiny_drafter(target()).to(torch.float64))
    with pytest.raises(ValueError, match="the drafter's dtype torch.float64"):
        generate(target(), ids(), drafter=oracle, tree_budget=4)


# ---- a truncated drafter checkpoint ----

@pytest.mark.parametrize("cut", [1, 4096, "header"])
def test_truncated_drafter_weights_name_the_file(tmp_path, cut):
    tiny_drafter(target()).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:6] if cut == "header" else data[:-cut])
    with pytest.raises(CheckpointError, match=re.escape(str(file)) + ": truncated"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_truncated_drafter_config_names_the_file(tmp_path):
    tiny_drafter(target()).save_pretrained(tmp_path)
    file = tmp_path / "config.json"
    file.write_text(file.read_text()[:40])
    with pytest.raises(CheckpointError, match=re.escape(str(file)) + ": not valid JSON"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_a_whole_drafter_checkpoint_still_loads(tmp_path):
    drafter = tiny_drafter(target())
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))
