"""Every environment switch of torch_kdtree, declared once: its type, default, when it is read and
what it does.  Nothing else in the repository reads (or writes) the process environment: Python
code asks :func:`get` (or ``envs.NAME``), C++ gets the values passed in (``torch.ops.kdtree.
_set_launch_options``, set from here at import and by :func:`torch_kdtree.ops.set_pdl`), and
``setup.py`` loads this file by its path (before the package exists).

When a switch is read:
  - build: by ``setup.py`` / ``torch.utils.cpp_extension`` while the extension is compiled;
  - import: once, by ``import torch_kdtree``; a Python setter changes the value afterwards.

Two helpers touch the environment for others, unavoidably: :func:`export` writes
``TORCH_CUDA_ARCH_LIST``'s default and the toolkit ``setup.py`` found into it, because
``torch.utils.cpp_extension`` reads both from ``os.environ`` itself; :func:`child_environment` copies
it for a child process (tests and tools that start Python with other settings).

``python -m torch_kdtree.envs`` prints the current values; ``--markdown`` prints the README's
switch table (tests/test_envs.py keeps the two equal).  This module imports nothing but the
standard library (setup.py loads it without torch's extension built), so ``python
torch_kdtree/envs.py --markdown`` works in a checkout that is not built.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, NamedTuple, Optional

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}: expected 0 or 1, got {raw!r}")


def _auto_bool(name: str, raw: str) -> Optional[bool]:
    """``auto`` -> None, else a bool."""
    return None if raw.strip().lower() == "auto" else _bool(name, raw)


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _count(name: str, raw: str) -> int:
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}: expected a positive integer, got {raw!r}")
    return n


class Switch(NamedTuple):
    name: str
    type: str        # as the README shows it
    default: Any     # the value when the variable is unset or empty
    shown: str       # the default as the README shows it
    read: str        # "build" or "import" (see the module docstring)
    doc: str         # one line
    parse: Callable[[str, str], Any]
    aliases: tuple = ()  # older names, read when the switch itself is unset


SWITCHES: tuple[Switch, ...] = (
    Switch("KDTREE_PDL", "bool", True, "1", "import",
           "Programmatic dependent launch for the CUDA kernels and for inductor's Triton kernels of compiled "
           "generation steps; 0 launches every kernel plainly (interop with foreign kernels, debugging). "
           "`torch_kdtree.ops.set_pdl` changes it later; CUDA graphs keep the value they were captured with.",
           _bool),
    Switch("KDTREE_BUILD_CUDA", "auto, 0, 1", None, "auto", "build",
           "Compile the CUDA kernels: auto when nvcc is found, 1 fails without a toolkit, 0 builds CPU-only "
           "(schemas and the pure-torch reference kernels).",
           _auto_bool),
    Switch("KDTREE_TRACE", "bool", False, "0", "build",
           "Diagnostic build: the decode kernels stamp their phases (csrc/trace.cuh) and `kdtree::_trace` returns "
           "the stamps; a normal build's kernels are unchanged by it.",
           _bool),
    Switch("TORCH_CUDA_ARCH_LIST", "str", "9.0;12.0", "9.0;12.0", "build",
           "CUDA architectures to compile for (read by torch.utils.cpp_extension; setup.py supplies the default).",
           _text),
    Switch("CUDA_HOME", "path", None, "nvcc on PATH", "build",
           "The CUDA toolkit to build with (also read as CUDA_PATH); unset: the toolkit behind `nvcc` on PATH, "
           "a wrapper script followed.",
           _text, aliases=("CUDA_PATH",)),
    Switch("MAX_JOBS", "int", None, "unset", "build",
           "Parallel compile jobs (read by torch.utils.cpp_extension's ninja build); unset: ninja's default.",
           _count),
)

_BY_NAME = {s.name: s for s in SWITCHES}


def switch(name: str) -> Switch:
    """The declaration of switch ``name`` (KeyError for a name the registry does not hold)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a torch_kdtree switch (torch_kdtree/envs.py holds them all)") from None


def get(name: str) -> Any:
    """The typed value of switch ``name`` now: its parsed environment value, or its default when it
    (and every alias) is unset or empty.  A malformed value raises ValueError naming the switch."""
    s = switch(name)
    for var in (s.name,) + s.aliases:
        raw = os.environ.get(var)
        if raw is not None and raw.strip():
            return s.parse(var, raw)
    return s.default


def __getattr__(name: str) -> Any:  # envs.KDTREE_PDL, ...
    if name in _BY_NAME:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def export(name: str, value: str, replace: bool = False) -> str:
    """Set switch ``name`` in this process's environment (only when it is unset, unless ``replace``),
    for a tool that reads it from ``os.environ`` itself (setup.py, for torch.utils.cpp_extension);
    returns the value in force."""
    switch(name)
    current = os.environ.get(name)
    if replace or current is None or not current.strip():
        os.environ[name] = value
        return value
    return current


def child_environment(**changes: Optional[str]) -> dict:
    """A copy of this process's environment for a child process (tests, tools), with ``changes``
    applied: a string sets a variable, None removes it.  This process's environment is unchanged."""
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def markdown_table() -> str:
    """The README's switch table, one row per switch."""
    rows = ["| Switch | Type | Default | Read at | What it does |", "|---|---|---|---|---|"]
    for s in SWITCHES:
        name = f"`{s.name}`" + "".join(f" (`{a}`)" for a in s.aliases)
        rows.append(f"| {name} | {s.type} | `{s.shown}` | {s.read} | {s.doc} |")
    return "\n".join(rows) + "\n"


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown_table())
        return 0
    if args:
        sys.stderr.write("usage: python -m torch_kdtree.envs [--markdown]\n")
        return 2
    for s in SWITCHES:
        print(f"{s.name} = {get(s.name)!r}  ({s.read})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
