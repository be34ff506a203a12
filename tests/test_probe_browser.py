"""The probe's HTML page in a real browser: nothing overflows at 390 px (a phone) or 1280 px, every image loads.

The same harness and the same rules as the report's page (tests/browser_harness.py). The pages come
from real SmolLM2 runs: ``--quick`` on the default text, and a full run (with the p-RoPE section)
on a shorter one.
"""

import pytest
import torch

import browser_harness
from browser_harness import WIDTHS, assert_fits, measure
from probe_helpers import PROMPT, example_model
from ropekit_lab import probe as lab_probe

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
browser = browser_harness.browser


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    loaded = example_model()
    try:
        text, label = lab_probe.default_text()
    except OSError:  # the KJV corpus cannot be fetched: a passage of it instead
        text, label = PROMPT * 20, "a passage of Genesis 1, repeated"
    out = {}
    for name, tokens, quick in (("quick", 256, True), ("full", 96, False)):
        ids = lab_probe.encode(loaded.tokenizer, text, tokens, "text")
        document = lab_probe.probe(loaded, ids, text=lab_probe.text_record(text, label), quick=quick, progress=False)
        out[name] = lab_probe.write_outputs(tmp_path_factory.mktemp(name) / "probe", document)
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", ["quick", "full"])
def test_probe_page_fits_the_screen_and_every_image_loads(browser, pages, name, width):
    assert_fits(measure(browser, pages[name], width), width, tables=4, images=7 if name == "quick" else 8)
