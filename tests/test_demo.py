"""The main job (python -m torch_kdtree.demo): it runs and finds DDTree == AR; bad options are argparse errors."""
import pytest

from torch_kdtree import demo


def test_demo_runs_and_ddtree_equals_autoregressive(capsys):
    demo.main(["--max-new-tokens", "6", "--batch", "2", "--budget", "auto", "--drafter", "oracle"])
    out = capsys.readouterr().out
    assert "DDTree output == autoregressive output: True" in out and "mean acceptance length" in out
    assert "per call (ms, medians of each part): DDTree wall" in out and ", the rest " in out


@pytest.mark.parametrize("argv,what", [
    (["--accuracy", "2"], "--accuracy: expected a number in [0.0, 1.0], got '2'"),
    (["--budget", "foo"], "--budget: expected 'auto' or an int in [1, 1024], got 'foo'"),
    (["--budget", "0"], "--budget: expected 'auto' or an int in [1, 1024], got '0'"),
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a number in [1, 4096], got '0'"),
    (["--block-size", "x"], "--block-size: expected a number in [2, 16], got 'x'"),
    (["--drafter", "nope"], "--drafter: invalid choice: 'nope'"),
])
def test_bad_options_are_argparse_errors(argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err


@pytest.fixture(scope="module")
def toy_pair(toy_pipeline):
    """A pair written by the training pipeline (toy recipe; conftest's one run): the main job's trained path."""
    return toy_pipeline[0]


def test_demo_on_a_trained_pair_decodes_held_out_code(toy_pair, capsys):
    import json

    demo.main(["--pair", str(toy_pair), "--max-new-tokens", "12", "--batch", "2"])
    out = capsys.readouterr().out
    first = json.loads((toy_pair / "prompts.json").read_text())["prompts"][0]["text"]
    assert f"trained: {toy_pair}" in out
    assert first.splitlines()[0] in out  # the prompt, decoded by the pair's tokenizer
    assert "--- completion (12 tokens)" in out and "DDTree / AR" in out
    assert "DDTree output == autoregressive output: True" in out


@pytest.mark.parametrize("argv,what", [
    (["--pair", "/nonexistent/pair"], "--pair: expected 'auto', 'random' or a directory with target/ and drafter/"),
])
def test_bad_pair_is_an_argparse_error(argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2 and what in capsys.readouterr().err


def test_block_size_belongs_to_the_trained_drafter(toy_pair, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--pair", str(toy_pair), "--block-size", "4"])
    assert e.value.code == 2 and "a trained drafter has its own block size" in capsys.readouterr().err


def test_bf16_outputs_that_differ_at_a_tie_pass_and_others_fail(capsys):
    """On a GPU the main job compares bf16 decodings: a divergence at an expert-choice tie (the sacred
    tests' rule) is reported and explained, one that no tie explains exits non-zero; fp32 asks for
    exact equality.  The tie: test_generate's construction (a near-tied expert choice whose two sides
    give different tokens; the target is fp32, the rule's arithmetic the same)."""
    import torch
    from test_generate import _expert_tie

    model, prefix, want, other, flipped, _ = _expert_tie(31, 1e-3)
    ids, mask = prefix[None], torch.ones(1, len(prefix), dtype=torch.long)
    sequence = lambda token: torch.cat([prefix, torch.tensor([token])])[None]
    demo.report_equality(model, ids, mask, sequence(want), sequence(want), exact=True)
    assert "DDTree output == autoregressive output: True" in capsys.readouterr().out
    demo.report_equality(model, ids, mask, sequence(other), sequence(want), exact=False)
    out = capsys.readouterr().out
    assert "output: False" in out and "expert-choice tie" in out and "up to bf16 ties: True (1 tie(s)" in out
    with pytest.raises(SystemExit, match="outputs differ$"):
        demo.report_equality(model, ids, mask, sequence(other), sequence(want), exact=True)
    base = model(prefix[None]).logits[0, -1].float()
    neither = int(torch.minimum(base, flipped).argmin())
    with pytest.raises(SystemExit, match="where no bf16 tie explains it: request 0 diverges at token 0"):
        demo.report_equality(model, ids, mask, sequence(neither), sequence(want), exact=False)
