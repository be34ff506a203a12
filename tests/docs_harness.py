"""Run the ```python blocks of one Markdown page in a fresh interpreter (a helper of tests/test_docs.py).

``python tests/docs_harness.py PAGE OUT RANK WORLD`` executes every block of ``PAGE`` (a path from the
repository root) that is not marked as an illustration, in order, in one namespace, with the
current directory as the page's scratch folder, and writes ``{fence line: traceback or null}`` to
``OUT`` as JSON. With ``WORLD > 1`` the process is rank ``RANK`` of a gloo group of ``WORLD``
processes (the rendezvous is the file ``rendezvous`` in the parent of the current directory).

What a block may take from its surroundings, and nothing else:

- **Hub names.** ``transformers.AutoModelForCausalLM``, ``AutoConfig`` and ``AutoTokenizer``
  ``.from_pretrained`` of a name in :data:`HUB_STAND_INS` (no downloads in tests) load a tiny random
  model of the same family, saved with a byte-level tokenizer under ``hub/``; an existing local
  folder loads as usual, and any other name is an error that says to add a stand-in.
- **Local folders.** ``path/to/llama`` (a tiny random Llama saved by ``save_pretrained``, half layout)
  and ``path/to/llama-interleaved`` (the same converted ``--to interleaved``) exist when the page
  names them.
- **transformers' kernel hooks.** transformers 5.23 attaches them only for ``kernels >= 0.18.2``; the
  pinned 0.17.2 has the same API, so its version check is widened before any modeling module is
  imported (as tests/hub_kernels_cases.py does).

A block fails when it raises, and when it uses a deprecated ropekit name (a ``DeprecationWarning``
``"<old> is deprecated; use <new>"``) or a ``from_pretrained`` keyword transformers deprecated
(``torch_dtype=``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time
import traceback
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the line before a fence that marks its block as an illustration, with the reason it cannot run
ILLUSTRATION = re.compile(r"<!--\s*illustration\b:?\s*(?P<reason>.*?)\s*-->")

#: hub name -> (model_type, config values of the real model that the tiny stand-in keeps)
HUB_STAND_INS = {
    "Qwen/Qwen3-0.6B": ("qwen3", dict(rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True)),
    "meta-llama/Llama-3.2-1B": ("llama", dict(rope_theta=5e5, max_position_embeddings=131072)),
}
#: the size of every stand-in: two layers of four query heads (two kv heads) of 16 channels
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)
#: the folders a page may name, built on demand: folder -> rows' layout
LOCAL_FOLDERS = {"path/to/llama-interleaved": "interleaved", "path/to/llama": "half"}


@dataclass(frozen=True)
class Block:
    """One fenced ```python block: its page, the line of its opening fence (1-based), code and marker."""

    page: str
    line: int
    code: str
    illustration: str | None  # None: runs; "" marked without a reason; else the reason

    @property
    def id(self) -> str:
        """``page:line``, the test id."""
        return f"{self.page}:{self.line}"


def python_blocks(page: str, text: str | None = None) -> list[Block]:
    """The ```python blocks of ``page`` (a path from the repository root; ``text``: its content), line by line.

    A fence opens at column 0 with ```` ```python ```` (optionally followed by words) and closes at the
    next line that is ```` ``` ````; other fences are skipped whole, so a python fence quoted inside
    another block is not a block.
    """
    lines = (text if text is not None else (ROOT / page).read_text(encoding="utf-8")).splitlines()
    blocks, index = [], 0
    while index < len(lines):
        line = lines[index]
        if not line.startswith("```"):
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].rstrip() == "```"), len(lines))
        info = line[3:].strip().split()
        if info[:1] == ["python"]:
            marker = ILLUSTRATION.fullmatch(lines[index - 1].strip()) if index else None
            blocks.append(Block(page, index + 1, "\n".join(lines[index + 1:end]) + "\n",
                                marker.group("reason") if marker else None))
        index = end + 1
    return blocks


# -- what a block may take from its surroundings ----------------------------------------------------


def _widen_kernels_gate() -> None:
    import transformers.utils.import_utils as import_utils

    accepts = import_utils.is_kernels_available
    import_utils.is_kernels_available = lambda MIN_VERSION="0.17.0", MAX_VERSION=import_utils.KERNELS_MAX_VERSION: (
        accepts(MIN_VERSION, MAX_VERSION))


def _byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer (256 byte tokens, then ``<|endoftext|>``) saved as a transformers tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.add_special_tokens({"eos_token": "<|endoftext|>"})
    fast.save_pretrained(directory)


def _tiny_model(directory: Path, model_type: str, **values) -> None:
    """A random ``model_type`` model of :data:`TINY` size (vocabulary: the byte tokenizer's) and its tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **TINY, vocab_size=260, eos_token_id=256,
                                               pad_token_id=256, **values)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    _byte_tokenizer(directory)


def _stand_in(name: str) -> Path:
    """The local folder that stands in for hub model ``name``, built on first use."""
    if name not in HUB_STAND_INS:
        raise ValueError(f"the docs test cannot download {name!r} and has no tiny stand-in for it: "
                         "add one to HUB_STAND_INS in tests/docs_harness.py")
    folder = Path("hub") / name.replace("/", "--")
    if not folder.exists():
        model_type, values = HUB_STAND_INS[name]
        _tiny_model(folder, model_type, **values)
    return folder


def _redirect_hub_names() -> None:
    """``from_pretrained`` of a hub name loads its stand-in; ``torch_dtype=`` is refused (use ``dtype=``)."""
    import transformers

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoConfig, transformers.AutoTokenizer):
        real = auto.from_pretrained.__func__

        def from_pretrained(cls, name, *args, _real=real, **kwargs):
            if "torch_dtype" in kwargs:
                raise TypeError("from_pretrained(torch_dtype=...) is deprecated in transformers: use dtype=")
            if isinstance(name, str) and not Path(name).exists():
                name = _stand_in(name)
            return _real(cls, name, *args, **kwargs)

        auto.from_pretrained = classmethod(from_pretrained)


def _local_folders(text: str) -> None:
    """The ``path/to/...`` folders ``text`` names: a tiny Llama in the half layout, and its interleaved twin."""
    from ropekit.checkpoints.convert import convert_checkpoint

    if "path/to/llama" not in text:
        return
    half = Path("path/to/llama")
    _tiny_model(half, "llama", rope_theta=5e5)
    if "path/to/llama-interleaved" in text:
        convert_checkpoint(half, Path("path/to/llama-interleaved"), dst_layout="interleaved")


# -- running --------------------------------------------------------------------------------------


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, DeprecationWarning) and re.search(r"is deprecated; use ", str(w.message))]


def run_page(page: str) -> dict[int, str | None]:
    """Execute the runnable blocks of ``page`` in order in one namespace: ``{fence line: traceback or None}``."""
    blocks = python_blocks(page)
    module = types.ModuleType("docs_page")  # a module, so that a block's dataclasses find their namespace
    sys.modules[module.__name__] = module
    results = {}
    for block in blocks:
        if block.illustration is not None:
            continue
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:  # leading newlines: a traceback names the page's own line numbers
                exec(compile("\n" * block.line + block.code, block.id, "exec"), module.__dict__)  # noqa: S102
                problem = None
            except BaseException:
                problem = traceback.format_exc()
        deprecated = _deprecations(caught)
        if deprecated and problem is None:
            problem = f"the block uses deprecated names: {deprecated}"
        results[block.line] = problem
        print(f"{block.id}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return results


def main(page: str, out: str, rank: int, world: int) -> None:
    """Prepare what the page may use, join the process group if any, run the page, write the results."""
    import torch

    torch.set_num_threads(1)
    text = (ROOT / page).read_text(encoding="utf-8")
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        _widen_kernels_gate()
        _redirect_hub_names()
        _local_folders(text)
    if world > 1:
        import torch.distributed as dist

        rendezvous = Path.cwd().parent / "rendezvous"
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    try:
        results = run_page(page)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()  # a peer blocked in a collective fails at once instead of timing out
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
