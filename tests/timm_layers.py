"""timm's rotary embeddings (``timm/layers/pos_embed_sincos.py``) without importing timm.

``import timm`` imports torchvision (timm's layers package pulls ``torchvision.ops``), which the
test environment does not install (timm is installed with ``--no-deps``; see the README). The module
we need imports only torch and three small siblings, so they are loaded from timm's files under a
private package name; ``timm`` itself is never imported or bound in ``sys.modules``.
"""

import importlib.util
import sys
import types
from pathlib import Path

PACKAGE = "_ropekit_tests_timm_layers"
FILES = ("trace_utils", "grid", "_fx", "pos_embed_sincos")


def pos_embed_sincos():
    """The ``timm.layers.pos_embed_sincos`` module, or ``None`` when timm is not installed."""
    if f"{PACKAGE}.pos_embed_sincos" in sys.modules:
        return sys.modules[f"{PACKAGE}.pos_embed_sincos"]
    spec = importlib.util.find_spec("timm")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    layers = Path(next(iter(spec.submodule_search_locations))) / "layers"
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(layers)]
    sys.modules[PACKAGE] = package
    for name in FILES:
        file_spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}", layers / f"{name}.py")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[f"{PACKAGE}.{name}"] = module
        file_spec.loader.exec_module(module)
    return sys.modules[f"{PACKAGE}.pos_embed_sincos"]
