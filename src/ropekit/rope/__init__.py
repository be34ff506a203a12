"""The maths of RoPE, the bottom layer: nothing here knows about kernels, modules or files.

- :mod:`.frequencies`: ``theta_i = base^(-2i/d)``, scaled frequencies, float64 angles and the
  float32 cos/sin tables every kernel consumes;
- :mod:`.scaling`: the context-extension rules (frozen dataclasses; public as ``ropekit.scaling``);
- :mod:`.layouts`: the two pairings (half, interleaved) and the q/k weight permutation between them;
- :mod:`.shards`: the global positions each rank of a context-parallel group holds
  (contiguous, zigzag, striped; packed batches);
- :mod:`.pairing`: which pairing a checkpoint was trained with, told from its q/k weights alone;
- :mod:`.analysis`: wavelengths, the long-term decay bound (RoFormer eq. 37), the similarity margin
  and the base a context needs (a config's whole description is the ``inspect`` verb's,
  :mod:`ropekit.cli.inspect_json`);
- :mod:`.axes`: multi-axis RoPE, :class:`~.axes.AxisPlan` (one axis and one frequency per pair) and
  its builders (M-RoPE, axial, pixel ladders); :mod:`.plans`: the plans of named models;
- :mod:`.grids` and :mod:`.mrope_positions`: position vectors of patches, videos and Qwen-VL sequences.
"""
