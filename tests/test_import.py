"""What ``import torch_kdtree`` loads: the ops only; ``torch_kdtree.models`` (and transformers) on
first use, from a source checkout and from an installed layout (setup.py maps ``models/`` to
``torch_kdtree/models``).  Each check runs in a fresh interpreter, since this process has long
imported the models."""
import os
import importlib.metadata
import subprocess
import sys
import textwrap

from torch_kdtree import envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The editable install's finder maps torch_kdtree.models to models/ by itself; dropping it leaves
# only what the package does (the source-checkout mount, or the installed folder).
NO_EDITABLE_FINDER = ("import sys\n"
                      "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n")


def _installed_or_checkout() -> str | None:
    """None (PYTHONPATH unset) where the package is installed, as scripts/setup.sh and CI install it;
    the checkout where it is not (the device machine runs the tests with PYTHONPATH only)."""
    try:
        importlib.metadata.distribution("torch_kdtree")
        return None
    except importlib.metadata.PackageNotFoundError:
        return ROOT


def _python(code: str, cwd, path: str | None = None) -> None:
    env = envs.child_environment(PYTHONPATH=path)  # None: unset
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_import_torch_kdtree_loads_the_ops_without_transformers(tmp_path):
    _python("""
        import sys
        import torch, torch_kdtree, torch_kdtree.demo
        assert 'transformers' not in sys.modules, 'import torch_kdtree imported transformers'
        assert 'torch_kdtree.models' not in sys.modules
        assert hasattr(torch.ops.kdtree, 'ddtree_build') and callable(torch_kdtree.ops.tree_accept)
        """, cwd=tmp_path, path=_installed_or_checkout())


def test_import_torch_kdtree_models_registers_the_auto_classes(tmp_path):
    _python("""
        import torch_kdtree.models
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        from torch_kdtree.models import KimiK2Config, KimiK2ForCausalLM, KimiK2Model
        assert type(AutoConfig.for_model(KimiK2Config.model_type)) is KimiK2Config
        assert AutoModelForCausalLM._model_mapping[KimiK2Config] is KimiK2ForCausalLM
        assert AutoModel._model_mapping[KimiK2Config] is KimiK2Model
        """, cwd=tmp_path, path=_installed_or_checkout())


def test_source_checkout_mounts_models_on_first_use(tmp_path):
    _python(NO_EDITABLE_FINDER + f"""
import os, torch_kdtree
assert 'transformers' not in sys.modules
from torch_kdtree.models import KimiK2ForCausalLM
import torch_kdtree.models
assert torch_kdtree.models.__file__ == os.path.join({ROOT!r}, 'models', '__init__.py')
assert torch_kdtree.models.KimiK2ForCausalLM is KimiK2ForCausalLM
from torch_kdtree.models.generation.tiny import tiny_target
""", cwd=tmp_path, path=ROOT)


def test_attribute_access_loads_the_models(tmp_path):
    _python(NO_EDITABLE_FINDER + """
import torch_kdtree
assert 'models' in dir(torch_kdtree) and 'transformers' not in sys.modules
assert torch_kdtree.models.DFlashDraftModel.__module__ == 'torch_kdtree.models.dflash.modeling'
""", cwd=tmp_path, path=ROOT)


def test_installed_layout_imports_models_from_inside_the_package(tmp_path):
    """The wheel's layout, built from links: site/torch_kdtree/{..., models/} as setup.py's
    package_dir maps it."""
    pkg = tmp_path / "site" / "torch_kdtree"
    pkg.mkdir(parents=True)
    src = os.path.join(ROOT, "torch_kdtree")
    for name in os.listdir(src):
        if name != "__pycache__":
            os.symlink(os.path.join(src, name), pkg / name)
    os.symlink(os.path.join(ROOT, "models"), pkg / "models")
    _python(NO_EDITABLE_FINDER + f"""
import torch_kdtree
assert torch_kdtree.__file__.startswith({str(tmp_path)!r}), torch_kdtree.__file__
assert 'transformers' not in sys.modules
assert not any(type(f).__name__ == '_SourceModelsFinder' for f in sys.meta_path)
from torch_kdtree.models import KimiK2ForCausalLM
import torch_kdtree.models
assert torch_kdtree.models.__file__ == {str(pkg / "models" / "__init__.py")!r}, torch_kdtree.models.__file__
""", cwd=tmp_path, path=str(tmp_path / "site"))

