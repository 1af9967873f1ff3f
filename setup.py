"""Build torch_kdtree._C.

CUDA kernels are compiled whenever nvcc is found (no GPU is needed to build) for
TORCH_CUDA_ARCH_LIST, default "9.0;12.0".  KDTREE_BUILD_CUDA=0 forces a CPU-only build
(schemas only; the CPU kernels are the pure-torch references), KDTREE_BUILD_CUDA=1 fails
loudly when CUDA cannot be built.  Every switch is declared in torch_kdtree/envs.py, loaded here by
its path (the package itself cannot be imported before its extension is built).
"""
import glob
import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup

from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("torch_kdtree", "csrc")


def _load_envs():
    spec = importlib.util.spec_from_file_location("_torch_kdtree_envs", os.path.join(ROOT, "torch_kdtree", "envs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


envs = _load_envs()


def _find_cuda_home():
    """CUDA_HOME (or CUDA_PATH), else the toolkit behind `nvcc` on PATH (which may be a wrapper script)."""
    home = envs.get("CUDA_HOME")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    real = os.path.realpath(nvcc)
    # A wrapper script (`exec /usr/local/cuda-X/bin/nvcc "$@"`): read the target from it.
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
        if head.startswith(b"#!"):
            for tok in head.decode(errors="ignore").split():
                if tok.endswith("/bin/nvcc") and os.path.exists(tok):
                    real = tok
                    break
    except OSError:
        pass
    home = os.path.dirname(os.path.dirname(real))
    return home if os.path.exists(os.path.join(home, "include", "cuda.h")) else None


def _want_cuda():
    flag = envs.get("KDTREE_BUILD_CUDA")  # None: auto
    if flag is False:
        return False
    home = _find_cuda_home()
    if home is None:
        if flag:
            sys.exit("KDTREE_BUILD_CUDA=1 but no CUDA toolkit was found (set CUDA_HOME or put nvcc on PATH)")
        return False
    envs.export("CUDA_HOME", home, replace=True)
    cpp_extension.CUDA_HOME = home  # torch resolved CUDA_HOME at import time
    return True


def _extension():
    sources = [os.path.join(CSRC, "bindings.cpp")]
    define_macros = []
    extra = {"cxx": ["-O3"]}
    trace = envs.get("KDTREE_TRACE")  # kernel phase stamps (csrc/trace.cuh), diagnostics only
    if _want_cuda():
        # torch.utils.cpp_extension reads the list from the environment itself
        archs = envs.export("TORCH_CUDA_ARCH_LIST", envs.switch("TORCH_CUDA_ARCH_LIST").default)
        sources += sorted(glob.glob(os.path.join(CSRC, "*.cu")))
        define_macros += [("KDTREE_WITH_CUDA", "1"), ("KDTREE_CUDA_ARCHS", '"%s"' % archs)]
        include_dirs = []
        try:  # the pip CUDA wheels carry headers (cuBLAS, cuSPARSE) a bare toolkit may lack
            import nvidia.cu13 as _cu13

            include_dirs.append(os.path.join(list(_cu13.__path__)[0], "include"))
        except ImportError:
            pass
        extra["nvcc"] = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
                         "-DKDTREE_WITH_CUDA=1"] + (["-DKDTREE_TRACE=1"] if trace else [])
        if trace:
            define_macros.append(("KDTREE_TRACE", "1"))
        return cpp_extension.CUDAExtension(
            "torch_kdtree._C", sources, define_macros=define_macros,
            include_dirs=include_dirs, extra_compile_args=extra)
    return cpp_extension.CppExtension(
        "torch_kdtree._C", sources, define_macros=define_macros, extra_compile_args=extra)


def _packages():
    """torch_kdtree and its subpackages, plus the top-level models/ tree mapped to torch_kdtree.models."""
    pkgs = ["torch_kdtree." + p if p else "torch_kdtree" for p in [""] + find_packages("torch_kdtree")]
    pkgs += ["torch_kdtree.models"] + ["torch_kdtree.models." + p for p in find_packages("models")]
    return pkgs


setup(
    packages=_packages(),
    package_dir={"torch_kdtree.models": "models"},
    # the trained default pair (python -m training.run writes it), shipped with installs
    package_data={"torch_kdtree.models": ["default_pair/*.md", "default_pair/*.json", "default_pair/*/*"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
