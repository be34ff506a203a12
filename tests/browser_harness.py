"""Headless Chromium for the HTML pages' layout tests (the report's and the probe's): open, measure, judge.

Chromium is driven over the DevTools protocol on a pipe and opens a page at each width (a phone
is emulated as a mobile device); :data:`MEASURE` runs in the page (the pages ship no script).
What counts as a defect (:func:`assert_fits`):

- an element or a line of text that reaches past the left or right edge of the page, unless it
  sits inside a box that clips it (``overflow-x`` other than ``visible``);
- a clipping box whose content is wider than the box: text cut off, or a table behind a scrollbar.
  Only a table declared inherently wide (``div.scroll.wide``) may scroll sideways, only with
  ``overflow-x: auto`` and only on a narrow screen; at 1280 px every table fits;
- an image that did not load (``naturalWidth`` 0).

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




def assert_fits(m: dict, width: int, *, tables: int, images: int) -> None:
    """The page measured at ``width`` (:func:`measure`) has at least ``tables`` tables and ``images`` images,
    every image loaded, nothing beyond the page, and no table cut off or scrolling where it may not."""
    assert m["inner_width"] == width and m["page_width"] <= width  # measured at the width asked for
    assert m["tables"] >= tables and len(m["images"]) >= images, (m["tables"], len(m["images"]))
    broken = [img["src"] for img in m["images"] if not (img["complete"] and img["natural_width"] > 0)]
    assert not broken, f"images that did not load at {width} px: {broken}"
    assert all(0 < img["width"] <= m["page_width"] for img in m["images"]), m["images"]
    assert not m["overflow"], f"beyond the page at {width} px: {json.dumps(m['overflow'][:8], indent=1)}"
    assert m["scroll_width"] <= m["page_width"], "the page scrolls sideways"
    allowed = [c for c in m["clipped"] if width < 640 and c["wide"] and c["overflow_x"] == "auto"]
    cut = [c for c in m["clipped"] if c not in allowed]
    assert not cut, f"cut off or behind a scrollbar at {width} px: {json.dumps(cut, indent=1)}"
