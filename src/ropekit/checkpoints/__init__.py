"""Layout conversion of real checkpoints (safetensors, sharded, ``.bin``/``.pth``).

:func:`convert_checkpoint` permutes the q/k projection rows between the half and interleaved
layouts; the geometry and source layout come from the checkpoint's own config and recorded
metadata (:mod:`.source`), outputs are written all-or-nothing (:mod:`.output`), reading is hardened
against hostile files (:mod:`.storage`), and ``verify`` checks the result against the float64
rotation matrices (:mod:`.verify`).
"""

from .convert import ConvertResult, HeadSpec, convert_checkpoint

__all__ = ["ConvertResult", "HeadSpec", "convert_checkpoint"]
