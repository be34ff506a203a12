"""Weights that look trained for the pairing detector: row norms log-linear in the rotary frequency."""

import torch

from ropekit import permute_qk_weight


def smooth_heads(n_heads, head_dim, *, layout, rotary_dim=None, slope=0.8, noise=0.05, in_features=48, seed=0,
                 dtype=torch.float64):
    """Rows ``exp(a_h + slope_h * i / (r/2) + noise) * unit vector``, ``i`` the pair of each channel in ``layout``.

    Returns ``(n_heads * head_dim, in_features)``: built in the half layout, then moved to ``layout``
    with :func:`ropekit.permute_qk_weight` (channels past ``rotary_dim`` get the same kind of profile).
    """
    g = torch.Generator().manual_seed(seed)
    r = rotary_dim or head_dim
    i = torch.arange(head_dim) % (r // 2)
    slopes = slope * (0.5 + torch.rand(n_heads, 1, generator=g, dtype=torch.float64))
    log_norm = (torch.randn(n_heads, 1, generator=g, dtype=torch.float64) + slopes * i / (r // 2)
                + noise * torch.randn(n_heads, head_dim, generator=g, dtype=torch.float64))
    rows = torch.randn(n_heads, head_dim, in_features, generator=g, dtype=torch.float64)
    rows = rows / rows.norm(dim=-1, keepdim=True) * log_norm.exp().unsqueeze(-1)
    w = rows.reshape(n_heads * head_dim, in_features)
    if layout == "interleaved":
        w = permute_qk_weight(w, n_heads, src="half", dst="interleaved", rotary_dim=r)
    return w.to(dtype)


def trained_like_state(layout, *, layers=3, heads=4, kv=2, head_dim=16, hidden=48, seed=0):
    """A Llama-named state dict whose q/k rows look trained in ``layout`` (v random, embeddings random)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(layers):
        p = f"model.layers.{i}.self_attn."
        sd[p + "q_proj.weight"] = smooth_heads(heads, head_dim, layout=layout, in_features=hidden, seed=seed + 2 * i,
                                               dtype=torch.bfloat16)
        sd[p + "k_proj.weight"] = smooth_heads(kv, head_dim, layout=layout, in_features=hidden,
                                               seed=seed + 2 * i + 1, dtype=torch.bfloat16)
        sd[p + "v_proj.weight"] = torch.randn(kv * head_dim, hidden, generator=g).to(torch.bfloat16)
    sd["model.embed_tokens.weight"] = torch.randn(32, hidden, generator=g)
    return sd
