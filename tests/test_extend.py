"""``ropekit extend``: the rules as configs, the evaluation against transformers' own forward, the choice, the CLI.

Oracles: transformers itself (a model built from the written config, its own rotary embedding and
eager attention, full logits), the probe's slow pairs, and plain arithmetic on synthetic rows.
"""

import hashlib
import json
import math

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

from probe_helpers import PROMPT, tiny_model_dir
from ropekit import RopeConfig, cos_sin
from ropekit.cli.entry import main
from ropekit_lab import extend as lab_extend
from ropekit_lab.extend_eval import (
    ANSWER_TOKENS,
    blockwise_nll,
    bucket_edges,
    evaluate_window,
    greedy_answer,
    passkey_window,
)
from ropekit_lab.extend_rules import RULES, candidate, candidates, pair_ranges, written_config
from ropekit_lab.probe_models import load_model_dir
from ropekit_lab.probe_stats import slow_pairs

TRAINED, TARGET = 64, 160
TEXT = (PROMPT + " ") * 40


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("extend") / "llama", max_position_embeddings=TRAINED)


def own_rope(hidden=32, heads=4, base=10000.0):
    config = transformers.LlamaConfig(hidden_size=hidden, num_attention_heads=heads, max_position_embeddings=TRAINED,
                                      rope_parameters={"rope_type": "default", "rope_theta": base})
    return config, RopeConfig.from_hf(config)


@given(target=st.integers(256, 70000), share=st.floats(0.05, 0.95), buckets=st.integers(2, 12))
def test_the_buckets_cover_the_window_with_the_trained_length_as_an_edge_and_none_nearly_empty(target, share, buckets):
    """Edges from 1 to T, L among them, and no bucket shorter than a quarter of an equal one (at 4x, the
    equal edge at L + 1 once left a bucket of one position)."""
    trained = max(2, min(target - 1, round(share * target)))
    edges = bucket_edges(target, trained, buckets)
    width = (target - 1) / buckets
    assert edges[0] == 1 and edges[-1] == target and trained in edges
    assert edges == sorted(set(edges)) and len(edges) <= buckets + 2
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        if {low, high} in ({1, trained}, {trained, target}):
            continue  # L itself near an end of the window: that bucket is as short as L is close
        assert high - low >= width / 4 - 1  # equal edges are rounded: half a position either side


def test_the_buckets_at_4x_put_the_trained_length_on_the_equal_edge_it_replaces():
    assert bucket_edges(32768, 8192, 8) == [1, 4097, 8192, 12289, 16384, 20480, 24576, 28672, 32768]
    assert bucket_edges(16384, 8192, 8) == [1, 2049, 4097, 6145, 8192, 10240, 12288, 14336, 16384]


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_the_written_config_gives_transformers_and_ropekit_the_tables_the_evaluation_used(name, style):
    config, own = own_rope()
    chosen = candidate(name, own, TRAINED, TARGET)
    source = config.to_dict()
    if style == "rope_scaling":  # the older form: rope_theta at the top, rope_scaling beside it
        source.pop("rope_parameters")
        source |= {"rope_theta": own.base, "rope_scaling": None}
    written = written_config(source, chosen)
    expected_inv, expected_scale = chosen.rope(own, TARGET).inv_frequencies(TARGET)
    read = RopeConfig.from_hf(written)
    got_inv, got_scale = read.inv_frequencies(TARGET)
    torch.testing.assert_close(got_inv, expected_inv, rtol=1e-12, atol=0)
    assert got_scale == pytest.approx(expected_scale, rel=1e-12)
    # transformers, from the same dict: its rotary embedding over positions 0..T-1
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**written))
    positions = torch.arange(TARGET)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, TARGET, 32), positions)
    ours_cos, ours_sin = cos_sin(positions, expected_inv, attention_scale=expected_scale)
    half = expected_inv.numel()
    torch.testing.assert_close(cos[..., :half], ours_cos, rtol=0, atol=2e-5)
    torch.testing.assert_close(sin[..., :half], ours_sin, rtol=0, atol=2e-5)


def test_the_probe_rule_interpolates_exactly_the_probes_slow_pairs():
    for base, trained in ((1e5, 8192), (1e4, 2048), (5e5, 4096)):
        _, own = own_rope(hidden=64 * 9, heads=9, base=base)
        theta, _ = own.inv_frequencies()
        slow = slow_pairs(theta, trained).nonzero().flatten().tolist()
        for factor in (2, 4):
            target = factor * trained
            ranges = {c.name: pair_ranges(c, own, trained, target) for c in candidates(list(RULES), own, trained,
                                                                                      target)}
            assert ranges["none"]["slow"] == slow and ranges["none"]["beyond"] == slow
            assert ranges["probe"]["beyond"] == [] and ranges["probe"]["compressed"] == []
            inv, _ = candidate("probe", own, trained, target).rope(own, target).inv_frequencies()
            torch.testing.assert_close(inv[slow], theta[slow] / factor)  # the slow pairs interpolated by s
            kept = [i for i in range(theta.numel()) if i not in slow]
            torch.testing.assert_close(inv[kept], theta[kept])  # the others as trained
            assert ranges["linear"]["beyond"] == [] and ranges["linear"]["compressed"] == kept
            # none: every slow pair reaches (T - 1) / (L - 1) times its trained angle
            assert ranges["none"]["max_angle_ratio_slow"] == pytest.approx((target - 1) / (trained - 1))


def test_blockwise_loss_equals_the_full_logits(llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    ids = torch.randint(1, 60, (1, 150))
    with torch.no_grad():
        full = model(ids).logits[0, :-1].double()
        hidden = model.model(ids).last_hidden_state[0, :-1]
        got = blockwise_nll(model, hidden, ids[0, 1:], block=16)
    want = torch.nn.functional.cross_entropy(full, ids[0, 1:], reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["none", "linear", "ntk", "dynamic", "yarn", "llama3", "probe"])
def test_the_evaluation_equals_transformers_eager_forward_under_the_written_config(llama, name):
    """ropekit's patch + sdpa + blockwise head == transformers' own eager model built from the written config."""
    loaded = load_model_dir(llama)
    own = RopeConfig.from_hf(loaded.model.config)
    chosen = candidate(name, own, TRAINED, TARGET)
    text_ids = lab_extend.text_ids_for(loaded.tokenizer, TEXT, TARGET, "--text")
    window = passkey_window(loaded.tokenizer, text_ids, TARGET, 0.3, seed=1)
    result = evaluate_window(loaded.model, window, chosen.rope(own, TARGET), loaded.tokenizer)
    written = written_config(json.loads((llama / "config.json").read_text()), chosen)
    oracle = transformers.LlamaForCausalLM(transformers.LlamaConfig(**written, attn_implementation="eager"))
    oracle.load_state_dict(loaded.model.state_dict())
    with torch.no_grad():
        logits = oracle.eval()(window.ids).logits[0, :-1].double()
    want = torch.nn.functional.cross_entropy(logits, window.ids[0, 1:], reduction="none")
    keep = window.text_target
    assert torch.isnan(result.nll[~keep]).all()
    torch.testing.assert_close(result.nll[keep], want[keep], rtol=1e-4, atol=1e-4)


def test_for_a_static_rule_the_first_l_positions_equal_an_l_token_run(llama):
    loaded = load_model_dir(llama)
    own = RopeConfig.from_hf(loaded.model.config)
    rope = candidate("yarn", own, TRAINED, TARGET).rope(own, TARGET)
    text_ids = lab_extend.text_ids_for(loaded.tokenizer, TEXT, TARGET, "--text")
    long = passkey_window(loaded.tokenizer, text_ids, TARGET, 0.9, seed=0)
    short = passkey_window(loaded.tokenizer, text_ids, TRAINED, 0.99, seed=0)
    n = min(long.key_position, short.key_position) - 1  # text only, in both
    a = evaluate_window(loaded.model, long, rope, loaded.tokenizer).nll[:n]
    b = evaluate_window(loaded.model, short, rope, loaded.tokenizer).nll[:n]
    assert torch.equal(long.ids[0, :n + 1], short.ids[0, :n + 1])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_passkey_window_hides_the_key_once_and_scores_exact_digits(llama, monkeypatch):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    loaded = load_model_dir(llama)
    digits_only = Tokenizer(models.WordLevel({"[UNK]": 0, **{str(d): d + 1 for d in range(10)}, "x": 11},
                                             unk_token="[UNK]"))
    digits_only.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                         pre_tokenizers.Digits(individual_digits=True)])
    digits_only.decoder = decoders.Fuse()  # digits decode as one number, as a BPE tokenizer's do
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=digits_only)
    text_ids = torch.full((400,), 11)
    window = passkey_window(tokenizer, text_ids, 120, 0.5, seed=3)
    assert window.ids.shape == (1, 120 - ANSWER_TOKENS) and len(window.key) == 5
    digits = [int(t) - 1 for t in window.ids[0].tolist() if 1 <= t <= 10]
    assert "".join(map(str, digits)) == window.key * 2  # "the pass key is K ... K is the pass key"
    assert abs(window.key_position - 0.5 * (120 - ANSWER_TOKENS)) <= 1
    inserted = (window.ids[0, 1:] != 11) & (window.ids[0, :-1] != 11)
    assert not (window.text_target & inserted).any()
    for answer, correct in ((window.key, True), (window.key + "0", False), ("1" + window.key[1:] if window.key[0]
                                                                            != "1" else "2" + window.key[1:], False)):
        ids = [int(c) + 1 for c in answer]
        monkeypatch.setattr("ropekit_lab.extend_eval.greedy_answer", lambda *a, ids=ids: ids)
        result = evaluate_window(loaded.model, window, RopeConfig.from_hf(loaded.model.config), tokenizer)
        assert result.correct is correct, (answer, window.key)


def test_greedy_answer_equals_transformers_generate(llama):
    loaded = load_model_dir(llama)
    ids = torch.randint(1, 60, (1, 40))
    with torch.no_grad():
        out = loaded.model.model(ids, use_cache=True)
        ours = greedy_answer(loaded.model, out.last_hidden_state[0, -1], out.past_key_values, 40)
        theirs = loaded.model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    assert ours == theirs[:len(ours)]
    assert len(ours) == ANSWER_TOKENS or ours[-1] == loaded.model.config.eos_token_id  # stops at the end token


def _row(name, trained, target, correct):
    return {"name": name, "trained": {"ppl": trained}, "target": {"ppl": target},
            "passkey": {"correct": correct, "total": 3}, "rope_parameters": {"rope_type": name},
            "max_position_embeddings": 1}


def test_the_choice_drops_rules_that_hurt_the_trained_context_and_breaks_ties_by_passkey():
    rows = [_row("none", 10.0, 100.0, 0), _row("linear", 11.0, 12.0, 3), _row("ntk", 10.4, 13.0, 1),
            _row("yarn", 10.3, 13.1, 2)]
    choice = lab_extend.choose(rows, tolerance=0.05)
    assert choice["dropped"] == ["linear"]  # 11 > 10 * 1.05
    assert choice["rule"] == "yarn"  # 13.1 is within 2% of ntk's 13.0, and it retrieves more keys
    assert lab_extend.choose(rows, tolerance=0.2)["rule"] == "linear"
    rows[3]["target"]["ppl"] = 14.0
    assert lab_extend.choose(rows, tolerance=0.05)["rule"] == "ntk"


def _sha(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_the_cli_measures_writes_the_page_and_a_config_transformers_loads(llama, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    before = _sha(llama)
    out, dst = tmp_path / "out", tmp_path / "extended"
    code = main(["extend", "--model", str(llama), "--to", str(TARGET), "--text", str(text), "--texts", "2",
                 "--out", str(out), "--write-config", str(dst), "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads(captured.out)
    assert document == json.loads((out / "extend.json").read_text())
    assert [r["name"] for r in document["rules"]] == list(RULES)
    assert document["lengths"] == {"trained": TRAINED, "target": TARGET, "factor": TARGET / TRAINED,
                                   "model_max_positions": TRAINED, "label": f"2.5x ({TRAINED} -> {TARGET})"}
    for row in document["rules"]:
        assert row["passkey"]["total"] == 2 and math.isfinite(row["target"]["ppl"])
        assert len(row["buckets"]) == len(document["buckets"]) - 1
    dynamic = next(r for r in document["rules"] if r["name"] == "dynamic")
    assert dynamic["trained"] == document["rules"][0]["trained"]  # dynamic NTK changes nothing up to L
    assert sorted(p.name for p in out.iterdir()) == ["buckets.png", "extend.json", "index.html", "pairs.png"]
    assert _sha(llama) == before  # the input is never touched
    chosen = document["choice"]
    assert document["written_config"] == str(dst.resolve())
    model = transformers.AutoModelForCausalLM.from_pretrained(dst)
    own = RopeConfig.from_hf(model.config)
    want = candidate(chosen["rule"], RopeConfig.from_hf(json.loads((llama / "config.json").read_text())),
                     TRAINED, TARGET).rope(own, TARGET).inv_frequencies(TARGET)
    got = own.inv_frequencies(TARGET)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.double(), got[0], rtol=1e-6, atol=0)
    original = transformers.AutoModelForCausalLM.from_pretrained(llama)
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def bad_cases(tmp_path, llama):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    exists = tmp_path / "exists"
    exists.mkdir()
    base = ["--model", str(llama)]
    return {
        (*base,): "--to",
        (*base, "--to", "32"): "longer than the trained context",
        (*base, "--to", "1"): "--to",
        (*base, "--to", "128", "--rules", "yarn,rope9"): "--rules",
        (*base, "--to", "128", "--tolerance", "nan"): "--tolerance",
        (*base, "--to", "128", "--out", str(busy)): "extend did not write",
        (*base, "--to", "128", "--write-config", str(exists)): "exists",
        (*base, "--to", "128", "--write-config", str(llama / "copy")): "inside the input",
        ("--model", str(tmp_path / "missing"), "--to", "128"): "no such directory",
        (*base, "--to", "128", "--text", str(tmp_path / "missing.txt")): "no such file",
        (*base, "--to", "100000", "--text", str(llama / "config.json")): "tokens",
    }


def test_bad_input_is_one_line_and_exit_code_2(llama, tmp_path, capsys):
    before = _sha(llama)
    cases = bad_cases(tmp_path, llama)
    for argv, words in cases.items():
        out = tmp_path / "out-never"
        try:  # argparse's own refusals exit through SystemExit, the verb's return the code
            code = main(["extend", *argv, *([] if "--out" in argv else ["--out", str(out)]), "--no-progress"])
        except SystemExit as stop:
            code = stop.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1, (argv, err)
        assert err.startswith("ropekit extend: error: ") and words in err, (argv, err)
        assert not out.exists(), argv
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert not (llama / "copy").exists() and _sha(llama) == before
    assert list((tmp_path / "exists").iterdir()) == []


def test_ctrl_c_during_a_forward_is_one_line_exit_130_and_leaves_no_output(tmp_path):
    """A real SIGINT while the progress bar counts layers: one line, exit 130, neither output folder nor copy."""
    import os
    import select
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    model = tiny_model_dir(tmp_path / "slow", num_hidden_layers=24, max_position_embeddings=1024)
    text = tmp_path / "long.txt"
    text.write_text(PROMPT * 200)
    src = Path(__file__).resolve().parent.parent / "src"
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
    out, dst = tmp_path / "new" / "extend", tmp_path / "copy"
    proc = subprocess.Popen([sys.executable, "-m", "ropekit", "extend", "--model", str(model), "--to", "4096",
                             "--text", str(text), "--texts", "1", "--out", str(out), "--write-config", str(dst)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    seen, deadline = b"", time.monotonic() + 240
    try:
        while b"layers" not in seen:  # the progress bar: a forward is under way
            assert time.monotonic() < deadline and proc.poll() is None, seen[-500:]
            if select.select([proc.stderr], [], [], 0.5)[0]:
                seen += os.read(proc.stderr.fileno(), 4096)
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = (seen + err).decode()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1].split("\r")[-1] == "ropekit extend: interrupted" and "Traceback" not in err
    assert stdout == b"" and not (tmp_path / "new").exists() and not dst.exists()
