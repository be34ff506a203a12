"""The HTML report in a real browser: nothing overflows at 390 px (a phone) or 1280 px, every image loads.

Headless Chromium, driven over the DevTools protocol on a pipe, opens each report at each width
(a phone is emulated as a mobile device) and runs :data:`MEASURE` in the page (the report itself
ships no script). What counts as a defect:

- an element or a line of text that reaches past the left or right edge of the page, unless it
  sits inside a box that clips it (``overflow-x`` other than ``visible``);
- a clipping box whose content is wider than the box: text cut off, or a table behind a scrollbar.
  Only a table declared inherently wide (``div.scroll.wide``) may scroll sideways, only with
  ``overflow-x: auto`` and only on a narrow screen; at 1280 px every table fits;
- an image that did not load (``naturalWidth`` 0).

Collapsed ``<details>`` are opened first, so the tables in them are measured too. The reports come
from :func:`ropekit.lab.report.write_report` with ``quick=True`` (the default configuration and
a scaled preset, whose tables have more columns and rows) and one real quick benchmark, plus
synthetic rows of the widest kinds a GPU run adds (Liger, ``torch.compile``, peak memory, both
flags), so the speed table is measured at its widest.
"""

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ropekit.cli.common import load_config
from ropekit.lab import bench
from ropekit.lab import report as report_module

torch.set_num_threads(1)

WIDTHS = (390, 1280)
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_PATHS = ("/usr/bin/chromium", "/usr/lib/chromium/chromium", "/snap/bin/chromium")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")

MEASURE = r"""
(() => {
  for (const d of document.querySelectorAll("details")) d.open = true;
  const page = document.documentElement.clientWidth, tol = 0.5;
  const clips = el => getComputedStyle(el).overflowX !== "visible";
  const clipper = el => {
    for (let e = el; e && e !== document.body; e = e.parentElement) if (clips(e)) return e;
    return null;
  };
  const label = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
    + [...el.classList].map(c => "." + c).join("");
  const path = el => {
    const parts = [];
    for (let e = el; e && e !== document.body; e = e.parentElement) parts.unshift(label(e));
    return parts.join(" > ");
  };
  const outside = r => r.left < -tol || r.right > page + tol;
  const overflow = [], clipped = [];
  for (const el of document.body.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    if (clips(el) && el.scrollWidth > el.clientWidth + 1) {
      clipped.push({path: path(el), wide: el.classList.contains("wide"), overflow_x: getComputedStyle(el).overflowX,
                    scroll_width: el.scrollWidth, client_width: el.clientWidth});
    }
    if (!clipper(el.parentElement) && outside(r)) {
      overflow.push({path: path(el), left: r.left, right: r.right, text: el.textContent.trim().slice(0, 80)});
    }
  }
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node; (node = walker.nextNode());) {
    if (!node.textContent.trim() || clipper(node.parentElement)) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    const rect = [...range.getClientRects()].find(outside);
    if (rect) overflow.push({path: path(node.parentElement) + " > #text", left: rect.left, right: rect.right,
                             text: node.textContent.trim().slice(0, 80)});
  }
  const images = [...document.images].map(img => ({src: img.getAttribute("src"), complete: img.complete,
    natural_width: img.naturalWidth, width: img.getBoundingClientRect().width}));
  return {inner_width: innerWidth, page_width: page, scroll_width: document.documentElement.scrollWidth,
          tables: document.querySelectorAll("table").length, overflow, clipped, images};
})()
"""


def find_chromium() -> str | None:
    """The Chromium (or Chrome) executable on PATH or at Debian's usual places, or ``None``."""
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    return next((p for p in CHROMIUM_PATHS if Path(p).is_file()), None)


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

    Chromium reads NUL-terminated JSON commands on its fd 3 and writes replies and events on fd 4.
    """

    def __init__(self, executable: str, profile: Path) -> None:
        command_read, self._command = os.pipe()
        self._reply, reply_write = os.pipe()
        shell = f'exec "$0" "$@" 3<&{command_read} 4>&{reply_write}'  # bash: fds above 9 (dash: 0-9)
        self.log = profile / "chromium.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(["bash", "-c", shell, executable, *FLAGS, f"--user-data-dir={profile}",
                                          "--remote-debugging-pipe", "about:blank"],
                                         pass_fds=(command_read, reply_write), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        os.close(command_read)
        os.close(reply_write)
        self._buffer, self._next_id, self._session = b"", 0, None
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self._session = self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})[
            "sessionId"]
        self.call("Page.enable")

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._reply], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._reply, 1 << 20) if ready else None
            if not chunk:
                log = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError("chromium " + ("timed out" if chunk is None else "closed the DevTools pipe")
                                   + f"; its output:\n{log}")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def wait(self, match, timeout: float = 60.0) -> dict:
        """The first message from Chromium that ``match(message)`` accepts (others are dropped)."""
        deadline = time.monotonic() + timeout
        while not match(message := self._message(deadline)):
            pass
        return message

    def call(self, method: str, params: dict | None = None) -> dict:
        """Send one command (to the page once attached) and return its ``result``."""
        self._next_id += 1
        command = {"id": self._next_id, "method": method, "params": params or {}}
        if self._session:
            command["sessionId"] = self._session
        os.write(self._command, json.dumps(command).encode() + b"\0")
        reply = self.wait(lambda m: m.get("id") == command["id"])
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def open(self, path: Path, width: int, height: int = 900) -> None:
        """Load ``path`` in a viewport ``width`` CSS px wide (a phone below 640 px) and wait for its load event."""
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": width < 640})
        self.call("Page.navigate", {"url": path.resolve().as_uri()})
        self.wait(lambda m: m.get("method") == "Page.loadEventFired")

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails']}")
        return result["result"]["value"]

    def close(self) -> None:
        try:
            self._session = None
            self.call("Browser.close")
            self.proc.wait(timeout=20)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._command)
            os.close(self._reply)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium found (looked for " + ", ".join(CHROMIUM_NAMES + CHROMIUM_PATHS)
                    + "); install it with `apt-get install -y chromium`, as .ci/run does")
    chromium = Chromium(executable, tmp_path_factory.mktemp("chromium-profile"))
    yield chromium
    chromium.close()


def measure(browser: Chromium, page: Path, width: int) -> dict:
    """Open ``page`` at ``width`` px and return what :data:`MEASURE` finds."""
    browser.open(page, width)
    return browser.evaluate(MEASURE)


def widest_bench_rows() -> list[dict]:
    """The real quick benchmark plus the widest rows a CUDA run adds (flags, Liger, compile, peak memory)."""
    rows = bench.run(quick=True)
    template = dict(rows[0], device="cuda", dtype="bfloat16", ms=123456.789, min_ms=0.00123, spread_pct=987.6,
                    gbps=1234.5, ratio_copy=7.0123, ratio_hf=1234.5, saved_mb=12345.6, peak_mb=12345.6,
                    flags=["noisy", "beats floor"], note="a made-up row as wide as any")
    return rows + [dict(template, impl=impl, mode=mode) for impl, mode in (
        ("liger-kernel", "in-place"), ("transformers + torch.compile", "out-of-place"), ("triton", "fwd+bwd"))]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    """``{name: index.html}`` of the default report and a scaled preset's, sharing one benchmark run."""
    rows = widest_bench_rows()
    root, out = tmp_path_factory.mktemp("browser"), {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report_module, "_bench_rows", lambda: (rows, None))
        for name in ("default", "llama-3.1"):
            config, label = load_config(None, name, None)
            report_module.write_report(root / name, config, label, quick=True)
            out[name] = root / name / "index.html"
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["default", "llama-3.1"])
def test_report_fits_the_screen_and_every_image_loads(browser, reports, name, width):
    m = measure(browser, reports[name], width)
    assert m["inner_width"] == width and m["page_width"] <= width  # measured at the width asked for
    assert m["tables"] >= 6 and len(m["images"]) >= 8
    broken = [img["src"] for img in m["images"] if not (img["complete"] and img["natural_width"] > 0)]
    assert not broken, f"images that did not load at {width} px: {broken}"
    assert all(0 < img["width"] <= m["page_width"] for img in m["images"]), m["images"]
    assert not m["overflow"], f"beyond the page at {width} px: {json.dumps(m['overflow'][:8], indent=1)}"
    assert m["scroll_width"] <= m["page_width"], "the page scrolls sideways"
    allowed = [c for c in m["clipped"] if width < 640 and c["wide"] and c["overflow_x"] == "auto"]
    cut = [c for c in m["clipped"] if c not in allowed]
    assert not cut, f"cut off or behind a scrollbar at {width} px: {json.dumps(cut, indent=1)}"


def test_the_measurement_sees_overflow_clipping_and_broken_images(browser, tmp_path):
    """The oracle itself: a page with each defect is reported, the same page without them is clean."""
    png = (Path(__file__).resolve().parent.parent / "docs" / "report-screenshot.png").read_bytes()
    (tmp_path / "ok.png").write_bytes(png)
    good = ('<!DOCTYPE html><html><head><meta name="viewport" content="width=device-width"><style>'
            "body{margin:0}img{max-width:100%}.scroll{overflow-x:auto}</style></head><body>"
            '<p>short text</p><img src="ok.png" alt="x"><div class="scroll wide"><table><tr>'
            + "<td>cell</td>" * 80 + "</tr></table></div></body></html>")
    (tmp_path / "good.html").write_text(good, encoding="utf-8")
    clean = measure(browser, tmp_path / "good.html", 390)
    assert not clean["overflow"] and clean["scroll_width"] == 390
    assert clean["images"][0]["natural_width"] == int.from_bytes(png[16:20], "big") > 390  # PNG header width
    assert [c["wide"] for c in clean["clipped"]] == [True]  # the wide table scrolls, nothing else

    defects = (f"<p>{'x' * 300}</p>"  # a word longer than the page
               + "<table><tr>" + "<td>nowrap-cell</td>" * 30 + "</tr></table>"  # a table wider than the page
               + '<div style="overflow:hidden;width:100px"><span style="white-space:nowrap">cut off text '
                 "that does not fit</span></div>")
    bad = good.replace("<p>short text</p>", defects).replace('src="ok.png"', 'src="missing.png"')
    (tmp_path / "bad.html").write_text(bad.replace("scroll wide", "scroll"), encoding="utf-8")
    broken = measure(browser, tmp_path / "bad.html", 390)
    assert {"#text" in o["path"] for o in broken["overflow"]} == {True, False}  # the word and the table
    assert broken["scroll_width"] > 390 and broken["images"][0]["natural_width"] == 0
    assert [(c["wide"], c["overflow_x"]) for c in broken["clipped"]] == [(False, "hidden"), (False, "auto")]
