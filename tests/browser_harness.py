"""Headless Chromium for the HTML pages' layout tests (the report's and the probe's): open, measure, judge.

Chromium is driven over the DevTools protocol on a pipe and opens a page at each width (a phone
is emulated as a mobile device); :data:`MEASURE` runs in the page (the pages ship no script).
What counts as a defect (:func:`assert_fits`):

- an element or a line of text that reaches past the left or right edge of the page, unless it
  sits inside a box that clips it (``overflow-x`` other than ``visible``);
- a clipping box whose content is wider than the box: text cut off, or a table behind a scrollbar;
- a table cell cut or out of sight when the page opens: its content wider than the cell, the
  cell hidden (``display``, ``visibility``, no size) while it holds text, or reaching past the
  visible part of a box that clips it (a column behind a scroll box's edge, a number cut
  mid-digit); and a table wider than the page that is not alone in its own box with
  ``overflow-x: auto``;
- an image that did not load (``naturalWidth`` 0), or that is drawn more than
  :data:`MAX_UPSCALE` times its natural width in device pixels (blurry, its text oversized);
- a figure whose smallest text, at the size the page draws the image, is under
  :data:`MIN_TEXT_PX` CSS pixels (given the text's size in the PNG, which only the page's
  author knows: :func:`smallest_text_px` reads it off a matplotlib figure).

Collapsed ``<details>`` are opened first, so the tables in them are measured too. Use the
fixture in a test module with ``browser = browser_harness.browser``.
"""

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

WIDTHS = (390, 768, 1280)  # a phone, a tablet, a desktop
MAX_UPSCALE = 1.25  # drawn width (device px) / natural width of an image
MIN_TEXT_PX = 9.0  # the smallest figure text a reader is asked to read, in CSS px
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
      clipped.push({path: path(el), overflow_x: getComputedStyle(el).overflowX, scroll_width: el.scrollWidth,
                    client_width: el.clientWidth});
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
  const images = [...document.images].map(img => {
    const r = img.getBoundingClientRect(), s = getComputedStyle(img), px = name => parseFloat(s[name]) || 0;
    return {src: img.getAttribute("src"), complete: img.complete, natural_width: img.naturalWidth, width: r.width,
            drawn_width: r.width - px("borderLeftWidth") - px("borderRightWidth") - px("paddingLeft")
                         - px("paddingRight")};
  });
  // the visible part of a clipping box, left to right: its client area (inside borders, scrollbar excluded)
  const view = box => { const left = box.getBoundingClientRect().left + box.clientLeft;
                        return [left, left + box.clientWidth]; };
  const cells = [], unboxed = [];
  for (const table of document.querySelectorAll("table")) {
    const box = clipper(table), width = table.getBoundingClientRect().width;
    const own = box === table.parentElement && box.querySelectorAll("table").length === 1
      && ["auto", "scroll"].includes(getComputedStyle(box).overflowX);
    if (width > page + tol && !own) unboxed.push({path: path(table), width, box: box ? path(box) : null});
    for (const cell of table.querySelectorAll("td, th")) {
      const r = cell.getBoundingClientRect(), s = getComputedStyle(cell), text = cell.textContent.trim();
      const problem = why => cells.push({path: path(cell), why, text: text.slice(0, 40), left: r.left,
                                         right: r.right});
      if (r.width < 1 || r.height < 1 || s.visibility !== "visible") {
        if (text && cell.tagName === "TD") problem("hidden");  // a header row may give way to labels in the cells
        continue;
      }
      if (cell.scrollWidth > cell.clientWidth + 1) problem("content wider than its cell");
      const range = document.createRange();  // what the reader sees of the cell: its content
      range.selectNodeContents(cell);
      const seen = text ? range.getBoundingClientRect() : r;
      for (let e = cell.parentElement; e && e !== document.body; e = e.parentElement) {
        if (!clips(e)) continue;
        const [left, right] = view(e);
        if (seen.left < left - tol || seen.right > right + tol) {
          problem("outside the visible part of " + path(e));
          break;
        }
      }
    }
  }
  return {inner_width: innerWidth, page_width: page, scroll_width: document.documentElement.scrollWidth,
          device_pixel_ratio: devicePixelRatio, tables: document.querySelectorAll("table").length, overflow,
          clipped, images, cells, unboxed};
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




def smallest_text_px(fig) -> float:
    """The font size of the smallest visible text of a drawn matplotlib ``fig``, in pixels of its PNG."""
    from matplotlib.text import Text

    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes) * fig.dpi / 72


def assert_fits(m: dict, width: int, *, tables: int, images: int, text_px: dict[str, float] | None = None) -> None:
    """The page measured at ``width`` (:func:`measure`) has at least ``tables`` tables and ``images`` images,
    every image loaded and drawn at most :data:`MAX_UPSCALE` times its size, nothing beyond the page, no
    table cut off, scrolling or hiding a column; ``text_px`` (``{src: smallest text in px of the PNG}``)
    adds that no figure's text is drawn under :data:`MIN_TEXT_PX`. Every defect found is reported at once."""
    assert m["tables"] >= tables and len(m["images"]) >= images, (m["tables"], len(m["images"]))
    found = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            found.append(message)

    broken = [img["src"] for img in m["images"] if not (img["complete"] and img["natural_width"] > 0)]
    check(not broken, f"images that did not load: {broken}")
    check(all(0 < img["width"] <= m["page_width"] for img in m["images"]), f"images wider than the page: {m['images']}")
    stretched = [f"{img['src']}: {img['drawn_width']:.0f} px from {img['natural_width']}" for img in m["images"]
                 if img["drawn_width"] * m["device_pixel_ratio"] > MAX_UPSCALE * img["natural_width"]]
    check(not stretched, f"images drawn over {MAX_UPSCALE}x their size: {stretched}")
    if text_px is not None:
        drawn = [(img["src"], text_px[img["src"]] * img["drawn_width"] / img["natural_width"]) for img in m["images"]
                 if img["natural_width"]]
        small = [(src, round(px, 1)) for src, px in drawn if px < MIN_TEXT_PX]
        check(not small, f"figure text under {MIN_TEXT_PX:g} px (smallest text, px): {small}")
    cut = m["cells"]
    check(not cut, f"{len(cut)} table cells cut or hidden: {json.dumps(cut[:6], indent=1)}")
    check(not m["unboxed"], f"tables wider than the page outside their own scroll box: {m['unboxed']}")
    check(not m["overflow"], f"beyond the page: {json.dumps(m['overflow'][:8], indent=1)}")
    check(m["scroll_width"] <= m["page_width"], "the page scrolls sideways")
    check(not m["clipped"], f"cut off or behind a scrollbar: {json.dumps(m['clipped'], indent=1)}")
    check(m["inner_width"] == width and m["page_width"] <= width,  # measured at the width asked for
          f"laid out {m['inner_width']} px wide on a {width} px screen")
    assert not found, f"at {width} px:\n- " + "\n- ".join(found)
