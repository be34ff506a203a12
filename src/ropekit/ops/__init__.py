"""The layer between the maths and the kernels: operators, kernels and the backend registry.

- :mod:`.operators`: every rotation form as a ``torch.library`` operator (schema, fake kernel,
  autograd), declared once; :mod:`.operators_fused` the same for the fused forms (RMSNorm +
  rotation, rotation into a KV cache), whose default kernels are in :mod:`.fused_eager`;
- kernels, one backend object each (:mod:`.backend` is the contract): :mod:`.cpu` (the C++
  kernel of ``csrc/``, built and cached by :mod:`.build`), :mod:`.triton` (CUDA), :mod:`.eager`
  (plain torch ops, any device);
- :mod:`.dispatch`: backends by name, ``"auto"`` by device, :func:`register` for new ones;
- :mod:`.reference`: the float64 rotation matrices, the oracle every kernel is tested against
  (never a dispatch target).
"""

from . import operators, operators_fused  # noqa: F401 - register the torch.ops.ropekit operators
from .backend import Backend
from .dispatch import available, get, register, resolve
from .positions import Positions

__all__ = ["Backend", "Positions", "available", "get", "register", "resolve"]
