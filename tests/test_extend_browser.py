"""``ropekit extend``'s HTML page in a real browser: nothing overflows at 390 px (a phone) or 1280 px, images load.

The same harness and rules as the report's and the probe's pages (tests/browser_harness.py); the page
comes from a run on a tiny random model (every rule, two windows), so that its tables have their
full width of columns.
"""

import pytest

import browser_harness
from browser_harness import WIDTHS, assert_fits, measure
from probe_helpers import PROMPT, tiny_model_dir
from ropekit_lab import extend as lab_extend
from ropekit_lab.extend_output import write_outputs
from ropekit_lab.extend_rules import RULES
from ropekit_lab.probe_models import load_model_dir

browser = browser_harness.browser


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("extend")
    loaded = load_model_dir(tiny_model_dir(folder / "llama", max_position_embeddings=64))
    ids = lab_extend.text_ids_for(loaded.tokenizer, (PROMPT + " ") * 40, 2 * 160, "--text")
    document = lab_extend.extend(loaded, ids, trained=64, target=160, rules=list(RULES), texts=2,
                                 text={"source": "Genesis 1, repeated"}, progress=False)
    return write_outputs(folder / "extend", document)


@pytest.mark.parametrize("width", WIDTHS)
def test_extend_page_fits_the_screen_and_every_image_loads(browser, page, width):
    assert_fits(measure(browser, page, width), width, tables=4, images=2)
