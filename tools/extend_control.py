"""The text's own difficulty beyond the trained context: the same tokens read by plain RoPE inside it.

    python tools/extend_control.py --to 16384 --context 8192

``ropekit extend``'s perplexity by position mixes two things: what a rule does to positions past
``L``, and how hard the text is there. This reads the tokens of extend's first window (the KJV,
the passkey at depth 10%, the same ids) from position ``T - L`` on as a window of its own of
``L`` tokens, with the model's own RoPE: positions inside the trained context. Printed (one JSON
line): the perplexity of its text tokens per bucket of ``L/4`` positions past ``L`` of the long
window, and over all of them. The first tokens of the control have little context, so its first
bucket is pessimistic.
"""

from __future__ import annotations

import argparse
import json
import math
import time


def main() -> None:
    """Run the control window and print the per-bucket perplexities."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", type=int, default=16384, help="extend's target length (default 16384)")
    parser.add_argument("--context", type=int, default=8192, help="the trained context (default 8192)")
    args = parser.parse_args()

    import torch

    from ropekit_lab import extend as lab_extend
    from ropekit_lab.extend_eval import backbone, blockwise_nll, load_attention, passkey_window
    from ropekit_lab.probe_models import load_example

    torch.set_num_threads(1)
    loaded = load_example()
    load_attention(loaded.model)
    text, _ = lab_extend.default_text()
    target, trained = args.to, args.context
    ids = lab_extend.text_ids_for(loaded.tokenizer, text, target, "--text")
    window = passkey_window(loaded.tokenizer, ids, target, lab_extend.DEPTHS[0], seed=0)
    start = window.ids.shape[1] - trained
    part = window.ids[:, start:]
    cpu = time.process_time()
    with torch.no_grad():
        hidden = backbone(loaded.model)(input_ids=part).last_hidden_state[0]
        nll = blockwise_nll(loaded.model, hidden[:-1], part[0, 1:])
    keep = window.text_target[start:]
    position = torch.arange(start + 1, start + part.shape[1])  # each target's position in the long window
    step = trained // 4
    out = {}
    for low in range(trained, target, step):
        mask = keep & (position >= low) & (position < low + step)
        if bool(mask.any()):
            out[f"{low}-{low + step - 1}"] = round(math.exp(float(nll[mask].mean())), 4)
    mask = keep & (position >= trained)
    out["beyond"] = round(math.exp(float(nll[mask].mean())), 4)
    out["cpu_s"] = round(time.process_time() - cpu, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
