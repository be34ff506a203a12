"""Layout conversion of real checkpoints (safetensors, sharded, ``.bin``/``.pth``).

:func:`convert_checkpoint` permutes the q/k projection rows between the half and interleaved
layouts; the geometry and source layout come from the checkpoint's own config and recorded
metadata (:mod:`.source`), outputs are written all-or-nothing (:mod:`.output`), reading is hardened
against hostile files (:mod:`.storage`), and ``verify`` checks the result against the float64
rotation matrices (:mod:`.verify`). :func:`detect_checkpoint_layout` asks the q/k weights which
pairing they were trained with (:mod:`.pairing`); ``convert_checkpoint`` uses it to refuse a
conversion that would scramble a checkpoint already in the target layout. :func:`find_layers`
(the q/k projections of a state dict, :class:`QKLayer` each), :func:`qk_projections` and
:func:`detect_tensors_layout` do the same on tensors already in memory.
"""

from .convert import ConvertResult, HeadSpec, convert_checkpoint
from .pairing import detect_checkpoint_layout, detect_tensors_layout, qk_projections
from .qk_tensors import QKLayer, find_layers

__all__ = ["ConvertResult", "HeadSpec", "QKLayer", "convert_checkpoint", "detect_checkpoint_layout",
           "detect_tensors_layout", "find_layers", "qk_projections"]
