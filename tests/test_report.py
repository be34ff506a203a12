"""``ropekit report``: the real console script writes a self-contained, captioned, phone-readable page.

Two ``--quick`` reports are built once per module, concurrently: the built-in default with no
arguments through the real console script, and a scaled preset with ``--json`` through
``ropekit.cli.entry`` (with the benchmark stubbed: the first report times the real one);
everything else inspects their files.
"""

import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
import types
from contextlib import redirect_stderr, redirect_stdout
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from fs_step_helpers import stop_after
from ropekit.cli.entry import main
from ropekit_lab import bench_rows, report_html, report_speed
from ropekit_lab import report as report_module

torch.set_num_threads(1)

SCRIPT = Path(sys.executable).parent / "ropekit"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "ropekit"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
if ENV.get("PYTHONPATH"):  # the console script runs in a temporary directory: a relative entry must not move
    ENV["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry) for entry in ENV["PYTHONPATH"].split(os.pathsep))


class Page(HTMLParser):
    """Collects the tags, attributes and nesting of an HTML document."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict, tuple[str, ...]]] = []  # (tag, attrs, ancestors)
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs), tuple(self.stack)))
        if tag not in ("img", "meta", "br", "link", "input", "hr"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack.pop() != tag:
                pass

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The default report through the console script and, meanwhile, a scaled preset through ``main``."""
    root = tmp_path_factory.mktemp("reports")
    proc = subprocess.Popen([*COMMAND, "report", "--quick"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env=ENV)
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(stdout), redirect_stderr(stderr):
        patch.setattr(report_module, "_bench_rows", lambda: (None, None))  # the subprocess times the real one
        code = main(["report", "--quick", "--json", "--preset", "llama-3.1", "--out", str(root / "l31")])
    scaled = subprocess.CompletedProcess(["report"], code, stdout.getvalue(), stderr.getvalue())
    out, err = proc.communicate(timeout=300)
    return root, subprocess.CompletedProcess(proc.args, proc.returncode, out, err), scaled


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def test_default_report_is_written_to_ropekit_report_and_its_path_printed(reports):
    root, default, _ = reports
    assert default.returncode == 0, default.stderr
    index = root / "ropekit-report" / "index.html"
    assert default.stdout.strip() == str(index.resolve())
    assert index.exists() and not [p for p in index.parent.iterdir() if p.name.startswith(".")]  # no staging left
    text = index.read_text(encoding="utf-8")
    for words in ("head_dim 128, base 10000", "Long-term decay", "Wavelengths per pair", "Sinusoidal PE",
                  "Properties checked live", "Speed", "arXiv:2405.14591", "Su et al. 2021", "pass"):
        assert words in text, words
    assert "FAIL" not in text


def test_scaled_report_json_summary(reports):
    root, _, scaled = reports
    assert scaled.returncode == 0, scaled.stderr
    summary = json.loads(scaled.stdout)
    assert summary["index"] == str((root / "l31" / "index.html").resolve())
    assert summary["config"]["rope_type"] == "llama3" and summary["config"]["context"] == 131072
    assert all(check["passed"] for check in summary["checks"]) and len(summary["checks"]) >= 7
    assert summary["decay"]["at_0"] == pytest.approx(32.5)
    assert summary["sinusoidal"]["rope_spread"] < 1e-9 < summary["sinusoidal"]["cross_term_spread"]
    assert {"20000", "1000000"} <= set(summary["bf16_precision"])
    assert summary["scaling"][0]["name"] == "this config (llama3)"
    text = (root / "l31" / "index.html").read_text(encoding="utf-8")
    assert "extrapolated" in text and "interpolated" in text and "pre-training" in text


@pytest.mark.parametrize("which", ["ropekit-report", "l31"])
def test_every_image_exists_and_nothing_is_fetched(reports, which):
    out = reports[0] / which
    page = parse(out / "index.html")
    images = [attrs["src"] for tag, attrs, _ in page.tags if tag == "img"]
    assert len(images) >= 8
    for src in images:
        assert "/" not in src and (out / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
    for tag, attrs, _ in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed"), tag
        for name in ("src", "href", "srcset", "action", "data", "poster"):
            if name in attrs:
                value = attrs[name] or ""
                assert not re.match(r"\s*(https?:)?//", value, re.I), (tag, name, value)
                assert name != "href" or value.startswith("#"), value  # only in-page links
    raw = (out / "index.html").read_text(encoding="utf-8")
    assert "@import" not in raw and "url(" not in raw and "<script" not in raw.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", raw, re.I)


@pytest.mark.parametrize("which", ["ropekit-report", "l31"])
def test_layout_is_captioned_and_phone_readable(reports, which):
    page = parse(reports[0] / which / "index.html")
    metas = [attrs for tag, attrs, _ in page.tags if tag == "meta"]
    assert {"name": "viewport", "content": "width=device-width, initial-scale=1"} in metas
    assert any(attrs.get("charset") == "utf-8" for attrs in metas)
    figures = sum(tag == "figure" for tag, _, _ in page.tags)
    captions = [ancestors for tag, _, ancestors in page.tags if tag == "figcaption"]
    assert figures >= 7 and len(captions) == figures and all("figure" in a for a in captions)
    for tag, attrs, ancestors in page.tags:
        if tag == "img":
            assert "figure" in ancestors and attrs.get("alt"), attrs
        if tag == "table":
            assert "div" in ancestors  # every table sits in a box that scrolls if it must
    raw = (reports[0] / which / "index.html").read_text(encoding="utf-8")
    assert "img{max-width:100%" in raw and ".scroll{overflow-x:auto" in raw
    # a table too wide for a phone stacks its rows there, each value labelled with its column's header
    # (tests/test_report_browser.py checks in a browser that no table scrolls, cuts or hides a cell)
    stacked = stacked_tables(raw)
    assert {"checks", "pairs"} <= set(stacked), set(stacked)
    for name, (headers, labels) in stacked.items():
        assert labels and all(row == headers[:len(row)] for row in labels), name


def stacked_tables(raw: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """``{name: (header texts, data-label of each cell per row)}`` of each table in a ``stack-*`` box."""
    found = {}
    for box in re.findall(r'<div class="scroll stack-(?:phone|tablet)">(.*?)</table></div>', raw, re.S):
        name = re.search(r'aria-describedby="([^"]+)-legend"', box).group(1)
        headers = [html.unescape(re.sub(r"<[^>]+>", "", h)) for h in re.findall(r"<th[^>]*>(.*?)</th>", box, re.S)]
        rows = re.findall(r"<tr>(.*?)</tr>", box.split("<tbody>")[1], re.S)
        found[name] = (headers, [[html.unescape(label) for label in re.findall(r'<td[^>]*data-label="([^"]*)"', row)]
                                 for row in rows])
    return found


def test_write_report_is_all_or_nothing_at_every_step(tmp_path, monkeypatch):
    """Stopped before any file-system step, ``out`` is the whole old report or the whole new one."""
    from ropekit import files as files_module

    out = tmp_path / "out"
    out.mkdir()
    old = {"index.html": b"previous report", "a.png": b"\x89PNG old a", "c.png": b"\x89PNG old c"}
    new_figures = {"a.png": b"\x89PNG new a", "b.png": b"\x89PNG new b"}
    new = {**new_figures, "index.html": b"<html>new</html>"}
    monkeypatch.setattr(report_module, "build", lambda *a, **k: ("<html>new</html>", new_figures, {"checks": []}))

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        for name, data in old.items():
            (out / name).write_bytes(data)

    def content():
        return {p.name: p.read_bytes() for p in out.iterdir()}

    steps = []
    monkeypatch.setattr(files_module, "fs_step", lambda action, path: steps.append(action))
    reset()
    report_module.write_report(out, None, "x")
    assert content() == new and len(steps) >= 4
    for stop in range(1, len(steps) + 1):
        reset()
        stop_after(monkeypatch, stop - 1, KeyboardInterrupt(steps[stop - 1]))
        with pytest.raises(KeyboardInterrupt):
            report_module.write_report(out, None, "x")
        assert content() in (old, new), (stop, steps[stop - 1])
        monkeypatch.setattr(files_module, "fs_step", lambda action, path: None)
        summary = report_module.write_report(out, None, "x")  # the next run finishes and leaves nothing behind
        assert content() == new and summary["index"] == str((out / "index.html").resolve())
        assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_write_report_refuses_a_directory_of_other_files(tmp_path, monkeypatch):
    monkeypatch.setattr(report_module, "build", lambda *a, **k: ("<html>new</html>", {}, {"checks": []}))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        report_module.write_report(tmp_path, None, "x")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_failing_build_writes_nothing(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(report_module, "build", broken)
    with pytest.raises(RuntimeError):
        report_module.write_report(tmp_path / "new", None, "x")
    assert not (tmp_path / "new").exists()


def test_bench_section_when_the_module_is_missing_or_fails(monkeypatch):
    fake = types.SimpleNamespace(summary={}, sections=[])
    monkeypatch.setattr(report_module.importlib.util, "find_spec", lambda name: None)
    report_module._Report.bench(fake)
    assert fake.summary["bench"] is None
    assert "not available" in fake.sections[0][2] and "ropekit bench" in fake.sections[0][2]

    fake = types.SimpleNamespace(summary={}, sections=[])
    monkeypatch.setattr(report_module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "ropekit_lab.bench", types.SimpleNamespace(run=lambda quick: 1 / 0))
    report_module._Report.bench(fake)
    assert "ZeroDivisionError" in fake.sections[0][2]

    rows = [bench_row("copy (x.clone)", ms=1.5), bench_row("cpu", ms=0.5, ratio_copy=3.0, flags=["beats floor"])]
    monkeypatch.setitem(sys.modules, "ropekit_lab.bench", types.SimpleNamespace(run=lambda quick: rows))
    fake = types.SimpleNamespace(summary={}, sections=[])
    report_module._Report.bench(fake)
    speed = fake.sections[0][2]
    assert '<td data-label="ms">1.5</td>' in speed and "1&times;2&times;2&times;8&times;16" in speed


def bench_row(impl, **values):
    """A row as ``ropekit_lab.bench.run`` returns it, with made-up numbers."""
    row = {"shape": "tiny", "dims": [1, 2, 2, 8, 16], "dtype": "float32", "device": "cpu", "impl": impl,
           "mode": "out-of-place", "ms": 1.0, "error_pct": 1.0, "median_ms": 1.1, "min_ms": 0.9, "spread_pct": 2.0,
           "repeats": 12, "bytes": 8 << 20, "gbps": 8.4, "ratio_copy": 1.0, "ratio_hf": 3.0, "saved_mb": None,
           "peak_mb": None, "flags": [], "note": None, "load_avg": 0.5, "cores": 2, "budget_s": 6.0, "used_s": 1.5}
    row.update(values)
    if row["flags"]:
        row["note"] = f"why {impl} is flagged"
    return row


def legends(text: str) -> dict[str, list[str]]:
    """``{legend id: [its terms]}`` of every ``<dl class="legend">`` in a page."""
    found = re.findall(r'<dl class="legend" id="([^"]+)">(.*?)</dl>', text, re.S)
    return {ident: [html.unescape(t) for t in re.findall(r"<dt>(.*?)</dt>", body, re.S)] for ident, body in found}


def tables(text: str) -> list[tuple[str, list[str]]]:
    """``(aria-describedby, [header texts])`` of every table in a page."""
    out = []
    for attrs, body in re.findall(r"<table([^>]*)>(.*?)</table>", text, re.S):
        described = re.search(r'aria-describedby="([^"]+)"', attrs)
        headers = [html.unescape(re.sub(r"<[^>]+>", "", h)) for h in re.findall(r"<th[^>]*>(.*?)</th>", body, re.S)]
        out.append((described.group(1) if described else "", headers))
    return out


@pytest.mark.parametrize("which", ["ropekit-report", "l31"])
def test_every_table_says_what_its_columns_mean(reports, which):
    text = (reports[0] / which / "index.html").read_text(encoding="utf-8")
    found, explained = tables(text), legends(text)
    assert len(found) >= 6 + (which == "ropekit-report")  # the scaled report is built without the speed table
    for legend_id, headers in found:
        assert legend_id in explained, (legend_id, headers)
        assert headers == explained[legend_id][:len(headers)], legend_id  # each header, in order, with a meaning
        assert len(explained[legend_id]) >= max(len(headers), 2)
    for ident, body in re.findall(r'<dl class="legend" id="([^"]+)">(.*?)</dl>', text, re.S):
        assert all(re.sub(r"<[^>]+>", "", dd).strip() for dd in re.findall(r"<dd>(.*?)</dd>", body, re.S)), ident


def test_the_speed_table_explains_dims_every_implementation_and_mode(reports):
    root, default, _ = reports
    text = (root / "ropekit-report" / "index.html").read_text(encoding="utf-8")
    speed = text[text.index('<section id="bench">'):]
    assert "dims = batch × query heads × key heads × sequence length × head_dim" in speed
    assert "prefill-1k</b> <span class=\"nw\">1&times;32&times;32&times;1024&times;128" in speed
    explained = legends(speed)
    impls = {html.unescape(i) for i in re.findall(r'<td class="text" data-label="impl">([^<]+)</td>', speed)}
    assert {"copy (x.clone)", "transformers eager", "cpu", "torch", "ropekit auto"} <= impls
    assert impls <= set(explained["speed-impl-legend"])
    assert {"out-of-place", "in-place", "fwd+bwd", "norm + rotation", "into cache"} == set(
        explained["speed-mode-legend"])  # the last two: the fused forms beside their peers, on the decode step
    for impl in impls:  # each with its own line, not the fallback for unknown backends
        assert html.escape(bench_rows.describe(impl)) in speed and "registered" not in bench_rows.describe(impl)


def test_flagged_rows_show_their_flag_and_what_it_means():
    rows = [bench_row("copy (x.clone)", error_pct=40.0, flags=["noisy"]),
            bench_row("cpu", ratio_copy=2.4, flags=["noisy", "beats floor"]),
            bench_row("torch", ratio_copy=0.6), bench_row("torch", ratio_copy=0.6, mode="in-place"),
            bench_row("cpu", mode="in-place"), bench_row("transformers eager")]
    text = report_speed.speed_section(rows)
    assert "<b>2 of 6 rows are flagged</b>" in text and "notice" not in text
    assert "1.5 s used" in text and "2 of 6 rows still noisy" in text  # how the rows were measured
    cells = re.findall(r'<span class="warn" title="([^"]*)">([^<]*)</span>', text)
    assert cells == [("why copy (x.clone) is flagged", "noisy"), ("why cpu is flagged", "noisy, beats floor")]
    explained = legends(text)
    assert explained["speed-flag-legend"] == ["noisy", "beats floor"]
    for flag in ("noisy", "beats floor"):
        assert html.escape(bench_rows.FLAGS[flag]) in text
    assert "peak MiB" not in text  # a CPU run has no peak-memory column

    quiet = report_speed.speed_section([bench_row("cpu", peak_mb=12.5)])
    assert "No row is flagged" in quiet and "speed-flag-legend" not in quiet and "<th>peak MiB</th>" in quiet


def test_a_machine_too_busy_to_measure_is_said_once_at_the_top_of_the_speed_section():
    rows = [bench_row("copy (x.clone)", error_pct=40.0, flags=["noisy"]),
            bench_row("cpu", ratio_copy=2.4, flags=["noisy", "beats floor"]), bench_row("torch", ratio_copy=0.6)]
    text = report_speed.speed_section(rows)
    notice = html.escape(bench_rows.busy_notice(rows))
    assert text.startswith(f'<p class="notice"><b>{notice}</b></p>') and text.count("too busy") == 1
    cells = re.findall(r'<span class="warn" title="([^"]*)">([^<]*)</span>', text)
    assert cells == [("why cpu is flagged", "beats floor")]  # no row is flagged noisy; the other flag stays
    assert legends(text)["speed-flag-legend"] == ["beats floor"] and "<b>1 of 3 rows are flagged</b>" in text


def test_a_table_without_columns_must_explain_its_rows():
    with pytest.raises(ValueError, match="needs terms"):
        report_html.table(None, [["a", 1]], name="bare")


def test_a_stacked_table_labels_every_value_and_leaves_blanks_out():
    columns = [("name", "what"), ("ms", "time"), ("ratio", "how fast")]
    grid = report_html.table(columns, [["<b>a</b>", 1.5, None]], name="t")
    assert '<div class="scroll">' in grid and "<td>-</td>" in grid and "data-label" not in grid
    stacked = report_html.table(columns, [["<b>a</b>", 1.5, None]], name="t", stack="phone")
    assert '<div class="scroll stack-phone">' in stacked
    assert '<td class="str" data-label="name"><b>a</b></td><td data-label="ms">1.5</td><td data-label="ratio"></td>' \
        in stacked
    for name, rem in report_html.STACK_BELOW_REM.items():  # each box class has its rules, up to its width
        assert f"@media (max-width:{rem}rem){{.stack-{name} table" in report_html.CSS
    with pytest.raises(ValueError, match="stack must be"):
        report_html.table(columns, [], name="t", stack="watch")
    with pytest.raises(ValueError, match="needs columns"):
        report_html.table(None, [["a", 1]], name="t", terms=[("a", "b")], stack="phone")


def test_without_matplotlib_the_page_says_so_instead_of_failing(monkeypatch):
    real_find_spec = report_module.importlib.util.find_spec
    monkeypatch.setattr(report_module.importlib.util, "find_spec",
                        lambda name, *args: None if name == "matplotlib" else real_find_spec(name, *args))
    monkeypatch.setattr(report_module, "_bench_rows", lambda: (None, None))
    from ropekit import RopeConfig

    text, files, summary = report_module.build(RopeConfig(16, max_positions=256), "tiny", quick=True)
    assert files == {} and summary["figures"] is False and "<img" not in text
    assert text.count("matplotlib is not installed") >= 7 and "Properties checked live" in text
