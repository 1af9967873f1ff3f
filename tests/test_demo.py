"""The main job (python -m torch_kdtree.demo): it runs and finds DDTree == AR; bad options are argparse errors."""
import pytest

from torch_kdtree import demo


def test_demo_runs_and_ddtree_equals_autoregressive(capsys):
    demo.main(["--max-new-tokens", "6", "--batch", "2", "--budget", "auto", "--drafter", "oracle"])
    out = capsys.readouterr().out
    assert "DDTree output == autoregressive output: True" in out and "mean acceptance length" in out


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
