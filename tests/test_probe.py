"""``ropekit probe`` on tiny random models: what it computes against an independent oracle, its errors, its outputs.

The oracle (tests/probe_helpers.py) runs the model with transformers' own rotation and eager
attention and computes the pair norms and the attention-by-distance profile with plain loops. The
real model (SmolLM2) is in tests/test_probe_smollm2.py.
"""

import argparse
import json

import pytest
import torch

from fs_step_helpers import Killed, stop_after
from probe_helpers import PROMPT, direct_statistics, tiny_model_dir
from ropekit import files
from ropekit.cli.entry import main
from ropekit_lab import probe as lab_probe
from ropekit_lab.probe_models import load_model_dir

torch.set_num_threads(1)
HEAD_KEYS = {"q_pair_norm", "k_pair_norm", "q_slow_energy_share", "k_slow_energy_share", "attention_by_distance",
             "diagonal", "previous_token", "sink", "fast_share_prev_logit", "prev_fast_only", "prev_slow_only", "kind"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("models") / "llama")


@pytest.mark.parametrize("family, extra", [("llama", {}), ("mistral", {"sliding_window": 8}),
                                           ("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                                                      "max_window_layers": 1})])
def test_statistics_equal_an_independent_computation(tmp_path, family, extra):
    """The capture forward's pair norms and attention by distance, every layer, equal the oracle's (windows too).

    The probe's own rotation (ropekit, the config's layout) against the model's own code.
    """
    loaded = load_model_dir(tiny_model_dir(tmp_path / family, family, **extra))
    model = loaded.model
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(1))  # any 48 token ids
    layers, _ = lab_probe.capture_run(model, ids, lab_probe.model_rope(model), progress=False)
    tables = lab_probe.head_tables(layers)
    for layer in range(model.config.num_hidden_layers):
        direct = direct_statistics(model, ids, layer)
        for key in ("q_pair_norm", "k_pair_norm", "attention_by_distance", "sink"):
            got = torch.tensor(tables[key][layer], dtype=torch.float64)
            torch.testing.assert_close(got, direct[key], rtol=2e-5, atol=2e-6, msg=f"{family} layer {layer} {key}")


def test_the_cli_writes_the_page_and_the_same_json_it_prints(llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["probe", "--model", str(llama), "--prompt", PROMPT, "--out", str(out), "--json",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed == json.loads((out / "probe.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted(["index.html", "probe.json", *printed["figures"]])
    assert printed["schema"] == "ropekit.probe/1" and set(printed["heads"]) == HEAD_KEYS
    n = printed["text"]["tokens"]
    heads = printed["heads"]
    assert len(heads["q_pair_norm"]) == 2 and len(heads["q_pair_norm"][0]) == 4 and len(heads["q_pair_norm"][0][0]) == 4
    assert len(heads["k_pair_norm"][0]) == 2 and len(heads["attention_by_distance"][0][0]) == n - 1
    assert printed["pairing"]["weights"]["layout"] is None  # random weights: the detector does not decide
    assert printed["pairing"]["layout"] == printed["pairing"]["loss"]["winner"]
    assert printed["quick"] is False and len(printed["p_rope"]["rows"]) == 5  # without --quick: the p-RoPE curve
    html = (out / "index.html").read_text()
    assert all(f'src="{name}"' in html for name in printed["figures"])


def test_the_help_tells_the_labs_own_defaults():
    from ropekit_lab.verbs import probe as cli_probe

    assert (cli_probe.QUICK_TOKENS, cli_probe.DEFAULT_TOKENS) == (lab_probe.QUICK_TOKENS, lab_probe.DEFAULT_TOKENS)


def test_p_rope_curve_without_quick(llama, tmp_path):
    loaded = load_model_dir(llama)
    ids = lab_probe.encode(loaded.tokenizer, PROMPT, 512, "--prompt")
    document = lab_probe.probe(loaded, ids, text={}, quick=False, progress=False)
    rows = document["p_rope"]["rows"]
    assert [r["p"] for r in rows] == [1.0, 0.75, 0.5, 0.25, 0.0] and [r["rotated_pairs"] for r in rows] == [4, 3, 2,
                                                                                                            1, 0]
    assert rows[0]["loss"] == document["pairing"]["loss"][document["pairing"]["layout"]]
    assert isinstance(document["claims"][2]["holds"], bool)


def bad_cases(tmp_path, llama):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("some text that is not a model")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n ")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    gpt2 = tiny_model_dir(tmp_path / "gpt2", "gpt2")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    model = ["--model", str(llama)]
    return {
        ("--model", str(tmp_path / "missing")): "no such directory",
        ("--model", str(a_file)): "not a directory",
        ("--model", str(empty_dir)): "no config.json in it",
        ("--model", str(broken)): "transformers cannot read its config",
        ("--model", str(vit)): "transformers has no causal LM for model_type 'vit'",
        ("--model", str(gpt2)): "model_type 'gpt2' is not a family ropekit patches: GPT2LMHeadModel: found 0 rotary",
        ("--gguf", str(a_file)): "not a GGUF file",
        ("--gguf", str(tmp_path / "missing.gguf")): "no such file",
        (*model, "--prompt", ""): "--prompt: the text is empty",
        (*model, "--prompt", "   "): "--prompt: the text is empty",
        (*model, "--prompt", "God"): "--prompt: the text gives 1 token(s); the probe needs at least 3",
        (*model, "--text", str(blank)): "--text: the text is empty",
        (*model, "--text", str(tmp_path / "none.txt")): "no such file",
        (*model, "--text", str(binary)): "not UTF-8 text",
        (*model, "--out", str(busy)): "holds files the probe did not write (notes.txt)",
        (*model, "--out", str(a_file)): "must be a directory",
    }


def test_bad_input_is_one_line_and_exit_code_2(llama, tmp_path, capsys):
    cases = bad_cases(tmp_path, llama)
    capsys.readouterr()  # what building the cases printed
    for argv, words in cases.items():
        out = tmp_path / "out-never"
        code = main(["probe", *argv, *([] if "--out" in argv else ["--out", str(out)])])
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1, (argv, err)
        assert err.startswith("ropekit probe: error: ") and words in err, (argv, err)
        assert not out.exists(), argv  # the output folder it created is gone again
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_the_output_folder_is_the_old_one_or_the_new_one_whatever_step_fails(llama, tmp_path, monkeypatch):
    """Writing is stopped before each file-system step in turn: the folder holds the old outputs, whole, or the new."""
    loaded = load_model_dir(llama)
    documents = {}
    for name, prompt in (("old", PROMPT), ("new", PROMPT.replace("light", "darkness"))):
        ids = lab_probe.encode(loaded.tokenizer, prompt, 512, "--prompt")
        documents[name] = lab_probe.probe(loaded, ids, text=lab_probe.text_record(prompt, "--prompt"), quick=True,
                                          progress=False)
    texts = {documents[name]["text"]["sha256"] for name in documents}
    out = tmp_path / "out"
    steps = []
    monkeypatch.setattr(files, "fs_step", lambda action, path: steps.append(action))
    lab_probe.write_outputs(out, dict(documents["new"]), figures=False)  # figures: a file each, no other step
    assert "exchange" in steps or "rename" in steps
    for n in range(len(steps)):
        monkeypatch.setattr(files, "fs_step", lambda action, path: None)
        lab_probe.write_outputs(out, dict(documents["old"]), figures=False)
        stop_after(monkeypatch, n)
        with pytest.raises(Killed):
            lab_probe.write_outputs(out, dict(documents["new"]), figures=False)
        monkeypatch.setattr(files, "fs_step", lambda action, path: None)
        document = json.loads((out / "probe.json").read_text())
        assert document["text"]["sha256"] in texts, n
        assert sorted(p.name for p in out.iterdir()) == sorted(["index.html", "probe.json", *document["figures"]]), n
        hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
        assert all(name.startswith(files.STAGING_PREFIX) for name in hidden), hidden
        files.remove_stale_staging(tmp_path)  # what a stopped run leaves is hidden, and the next write removes it
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(texts) == 2


def test_ctrl_c_during_the_capture_is_one_line_exit_130_and_leaves_no_folder(tmp_path):
    """A real SIGINT while the progress bar counts layers: one line, exit code 130, the new output folder removed."""
    import os
    import select
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    model = tiny_model_dir(tmp_path / "slow", num_hidden_layers=24, max_position_embeddings=4096)
    text = tmp_path / "long.txt"
    text.write_text(PROMPT * 60)
    src = Path(__file__).resolve().parent.parent / "src"
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "new" / "probe"
    proc = subprocess.Popen([sys.executable, "-m", "ropekit", "probe", "--model", str(model), "--text", str(text),
                             "--tokens", "2048", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    seen, deadline = b"", time.monotonic() + 240
    try:
        while b"probe (" not in seen:  # the progress bar: the capture forward is under way
            assert time.monotonic() < deadline and proc.poll() is None, seen[-500:]
            if select.select([proc.stderr], [], [], 0.5)[0]:
                seen += os.read(proc.stderr.fileno(), 4096)
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = (seen + err).decode()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "ropekit probe: interrupted" and "Traceback" not in err
    assert stdout == b"" and not (tmp_path / "new").exists()


def test_a_missing_path_fails_before_torch_loads(tmp_path):
    """``probe --model nosuchdir`` is refused in one line before torch and transformers are imported."""
    import subprocess
    import sys

    runner = ("import sys\nfrom ropekit.cli.entry import main\ncode = main(sys.argv[1:])\n"
              "sys.exit(99 if 'torch' in sys.modules else code)")
    for option in ("--model", "--gguf", "--text"):
        argv = ["probe", option, str(tmp_path / "nosuch"), "--out", str(tmp_path / "out")]
        if option == "--text":
            argv[1:1] = ["--model", str(tmp_path)]
        done = subprocess.run([sys.executable, "-c", runner, *argv], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (option, done.returncode, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "nosuch" in done.stderr, done.stderr
        assert not (tmp_path / "out").exists()


def test_no_progress_silences_transformers_bars_for_the_run(monkeypatch, tmp_path):
    from transformers.utils import logging as transformers_logging

    from ropekit_lab import probe as probe_module
    from ropekit_lab.verbs import probe as probe_verb

    seen = []
    monkeypatch.setattr(probe_module, "run", lambda args: seen.append(transformers_logging.is_progress_bar_enabled())
                        or 0)
    transformers_logging.enable_progress_bar()
    args = argparse.Namespace(model=str(tmp_path), gguf=None, text=None, no_progress=True)
    assert probe_verb.run(args) == 0 and seen == [False]
    assert transformers_logging.is_progress_bar_enabled()  # restored after the run
    args.no_progress = False
    assert probe_verb.run(args) == 0 and seen == [False, True]
