"""torch_kdtree/envs.py, the one registry of environment switches: the README's table is the
registry's, nothing else in the repository touches the environment, at most eight switches, typed
values, and the one runtime switch (KDTREE_PDL) reaching the C++ launches and inductor's options."""
import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from torch_kdtree import envs
from torch_kdtree.ops import pdl, pdl_enabled, set_pdl

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- switches:begin -->", "<!-- switches:end -->"
SOURCES = (".py", ".cu", ".cuh", ".cpp", ".h", ".hpp", ".c", ".cc")
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules"}
# The environment touched in this file's own patterns and in the registry: nowhere else.
OWNERS = {"torch_kdtree/envs.py", "tests/test_envs.py"}
ENV_ACCESS = re.compile(r"\benviron\b|getenv|putenv|setenv\(")
KDTREE_NAME = re.compile(r"\bKDTREE_[A-Z0-9_]+")
BUILD_MACROS = {"KDTREE_WITH_CUDA", "KDTREE_CUDA_ARCHS"}  # set by setup.py, not switches


def _sources():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                       and not d.endswith(".egg-info")]
        for name in filenames:
            if name.endswith(SOURCES):
                path = Path(dirpath) / name
                yield path.relative_to(ROOT).as_posix(), path.read_text(errors="replace")


def _offenders():
    """{path: [what]} for every source outside OWNERS that touches the environment or names a
    KDTREE_ variable that is neither a registered switch nor a build macro."""
    switches = {s.name for s in envs.SWITCHES}
    found = {}
    for rel, text in _sources():
        if rel in OWNERS:
            continue
        what = []
        for no, line in enumerate(text.splitlines(), 1):
            if ENV_ACCESS.search(line) and "monkeypatch" not in line:
                what.append(f"line {no}: {line.strip()}")
            for name in KDTREE_NAME.findall(line):
                if name not in switches and name not in BUILD_MACROS:
                    what.append(f"line {no}: {name} is not a switch (torch_kdtree/envs.py)")
        if what:
            found[rel] = what
    return found


def test_no_environment_access_or_unregistered_switch_outside_the_registry():
    """No source file (Python, C++, CUDA) reads or writes the environment except torch_kdtree/envs.py,
    and every KDTREE_ name in the code is a registered switch or a build macro (a removed switch
    leaves no mention behind)."""
    found = _offenders()
    assert not found, "\n".join(f"{p}:\n  " + "\n  ".join(w) for p, w in found.items())


def test_pytest_environment_changes_name_only_registered_switches():
    """monkeypatch.setenv / delenv in the tests set registered switches only (a removed switch set in
    a test would silently test nothing)."""
    switches = {s.name for s in envs.SWITCHES}
    bad = []
    for rel, text in _sources():
        if not rel.startswith("tests/") or rel in OWNERS:
            continue
        for m in re.finditer(r"monkeypatch\.(?:setenv|delenv)\(\s*[\"']([A-Z0-9_]+)[\"']", text):
            if m.group(1).startswith("KDTREE_") and m.group(1) not in switches:
                bad.append(f"{rel}: {m.group(1)}")
    assert not bad, bad


def test_at_most_eight_switches_each_declared_once():
    names = [s.name for s in envs.SWITCHES]
    assert len(names) <= 8, names
    assert len(set(names)) == len(names)
    for s in envs.SWITCHES:
        assert s.read in ("build", "import"), s
        assert s.doc and "\n" not in s.doc and "|" not in s.doc, s


def test_readme_switch_table_is_the_registrys():
    """README.md holds python -m torch_kdtree.envs --markdown between the switch markers."""
    readme = (ROOT / "README.md").read_text()
    assert BEGIN in readme and END in readme, f"README.md lacks the {BEGIN} ... {END} block"
    block = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    assert block.strip() == envs.markdown_table().strip(), "regenerate it: python -m torch_kdtree.envs --markdown"


def test_markdown_command_prints_the_table():
    out = io.StringIO()
    with redirect_stdout(out):
        assert envs.main(["--markdown"]) == 0
    assert out.getvalue() == envs.markdown_table()
    rows = out.getvalue().strip().splitlines()
    assert len(rows) == 2 + len(envs.SWITCHES)
    assert all(row.count("|") == 6 for row in rows)


def test_registry_loads_by_path_without_torch():
    """setup.py loads envs.py by its path before the package (and its extension) exists."""
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('e', {str(ROOT / 'torch_kdtree' / 'envs.py')!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "assert m.get('KDTREE_TRACE') is False and 'torch' not in sys.modules\n"
            "print(m.markdown_table(), end='')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=envs.child_environment(KDTREE_TRACE=None), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == envs.markdown_table()


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False),
                                      ("", True), (None, True)])
def test_bool_switch_values(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("KDTREE_PDL", raising=False)
    else:
        monkeypatch.setenv("KDTREE_PDL", raw)
    assert envs.get("KDTREE_PDL") is want
    assert envs.KDTREE_PDL is want


@pytest.mark.parametrize("raw", ["gemv,mla", "2", "maybe"])
def test_malformed_values_raise_naming_the_switch(monkeypatch, raw):
    monkeypatch.setenv("KDTREE_PDL", raw)
    with pytest.raises(ValueError, match="KDTREE_PDL"):
        envs.get("KDTREE_PDL")
    monkeypatch.setenv("MAX_JOBS", "0")
    with pytest.raises(ValueError, match="MAX_JOBS"):
        envs.get("MAX_JOBS")


def test_auto_path_and_alias_values(monkeypatch):
    for raw, want in (("auto", None), ("1", True), ("0", False)):
        monkeypatch.setenv("KDTREE_BUILD_CUDA", raw)
        assert envs.get("KDTREE_BUILD_CUDA") is want
    monkeypatch.delenv("KDTREE_BUILD_CUDA")
    assert envs.get("KDTREE_BUILD_CUDA") is None
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", "/opt/cuda")
    assert envs.get("CUDA_HOME") == "/opt/cuda"  # the older name, read when CUDA_HOME is unset
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    assert envs.get("CUDA_HOME") == "/usr/local/cuda"
    monkeypatch.setenv("MAX_JOBS", "3")
    assert envs.get("MAX_JOBS") == 3
    with pytest.raises(KeyError, match="KDTREE_GEMV_RING"):
        envs.get("KDTREE_GEMV_RING")
    with pytest.raises(AttributeError):
        envs.KDTREE_PREWAIT  # noqa: B018


def test_export_sets_only_unset_switches_unless_asked(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert envs.export("TORCH_CUDA_ARCH_LIST", "9.0") == "9.0"
    assert envs.get("TORCH_CUDA_ARCH_LIST") == "9.0"
    assert envs.export("TORCH_CUDA_ARCH_LIST", "12.0") == "9.0"  # the user's (here: the first) value wins
    assert envs.export("TORCH_CUDA_ARCH_LIST", "12.0", replace=True) == "12.0"
    with pytest.raises(KeyError):
        envs.export("KDTREE_GEMV_RING", "0")


def test_child_environment_is_a_changed_copy(monkeypatch):
    monkeypatch.setenv("KDTREE_PDL", "0")
    monkeypatch.delenv("MAX_JOBS", raising=False)
    env = envs.child_environment(KDTREE_PDL=None, MAX_JOBS="2")
    assert "KDTREE_PDL" not in env and env["MAX_JOBS"] == "2"
    assert envs.get("KDTREE_PDL") is False and envs.get("MAX_JOBS") is None  # this process: unchanged


def test_set_pdl_reaches_the_launch_option_and_restores():
    before = pdl_enabled()
    try:
        set_pdl(False)
        assert pdl_enabled() is False and torch.ops.kdtree._launch_options() is False
        with pdl(True):
            assert torch.ops.kdtree._launch_options() is True
        assert pdl_enabled() is False
        set_pdl(True)
        with pdl(False):
            assert pdl_enabled() is False
        assert pdl_enabled() is True
    finally:
        set_pdl(before)


def test_kdtree_pdl_is_applied_at_import():
    code = "import torch_kdtree.ops as o; print(o.pdl_enabled())"
    for raw, want in (("0", "False"), ("1", "True")):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env=envs.child_environment(KDTREE_PDL=raw))
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == want


def test_inductor_options_follow_the_pdl_switch(monkeypatch):
    """One switch for both: with PDL off the compiled steps' Triton kernels launch plainly too."""
    from torch_kdtree.models.generation.session import PDL_OPTION, inductor_options

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    has_option = hasattr(torch._inductor.config.triton, PDL_OPTION.split(".")[1])
    cuda = torch.device("cuda")
    with pdl(True):
        assert inductor_options({}, cuda) == ({PDL_OPTION: True} if has_option else {})
    with pdl(False):
        assert inductor_options({}, cuda) == {}
        assert inductor_options({PDL_OPTION: True}, cuda) == {PDL_OPTION: True}  # the caller's choice wins


def test_cuda_sources_never_read_the_environment():
    """The C++ gets every value passed in (pdl.cuh's launch_pdl(), set by kdtree::_set_launch_options)."""
    csrc = ROOT / "torch_kdtree" / "csrc"
    if not csrc.is_dir():
        pytest.skip("the C++ sources are not next to this copy of the package")
    for path in csrc.iterdir():
        assert "getenv" not in path.read_text(errors="replace"), path.name
