"""Drop-in RoPE for other libraries' models: :mod:`ropekit.integrations.transformers` (``patch`` / ``unpatch``)."""
