"""How the CUDA kernels launch: programmatic dependent launch (PDL) on or off, process-wide.

With PDL (the default) a kernel may start while the kernel before it on the stream finishes; the
kdtree decode kernels then read their weights before they wait for it (csrc/pdl.cuh), and the
compiled generation steps launch inductor's Triton kernels the same way
(``models/generation/session.py``'s ``inductor_options``).  Off, every kernel launches plainly:
for interop with foreign kernels that write our ops' weight arguments, or for debugging.

The value starts as ``KDTREE_PDL`` (:mod:`torch_kdtree.envs`, read at import).  The C++ reads it at
each launch, so a CUDA graph keeps the value it was captured with, and a session compiles its steps
with the value in force when it is built.
"""
from __future__ import annotations

import contextlib

import torch

from .. import envs


def set_pdl(enabled: bool) -> None:
    """Launch the CUDA kernels (and the Triton kernels of sessions built from now on) with
    programmatic dependent launch, or without it."""
    torch.ops.kdtree._set_launch_options(bool(enabled))


def pdl_enabled() -> bool:
    """Whether kernels launched now use programmatic dependent launch."""
    return bool(torch.ops.kdtree._launch_options())


@contextlib.contextmanager
def pdl(enabled: bool):
    """Context manager form of :func:`set_pdl`."""
    old = pdl_enabled()
    set_pdl(enabled)
    try:
        yield
    finally:
        set_pdl(old)


set_pdl(envs.get("KDTREE_PDL"))
