"""The playground page in a real browser (Debian's chromium through chromium-driver and Selenium,
nothing downloaded) against a real server with an API key, serving two shipped checkpoints
(weights/transformer-xl-stdlib and weights/adaptive-span-stdlib, the first alphabetically):

- the key typed into the page authenticates HTTP and the websocket (as a subprotocol);
- the page starts on transformer-xl-stdlib with 128-byte chunks, where the memory shows;
- generation streams and stops on cancel;
- a document of a few KB (with markup in it, shown as text) is read into a session, coloured by
  surprisal, scored lower with memory than without, and both curves drawn: "with memory" last,
  on axes with numbered ticks and units (the canvas's own calls are recorded to check this);
- "Continue the document" writes to its own output, leaving the Generate panel's alone;
- the session panel names the session's model, and picking a session switches the model to it;
- export then import gives a session with the same count; fork and delete;
- the Import button looks like the other buttons; at 420 px the panels stack in one column;
- the page loads nothing from another origin.

Screenshots of every step (wide and narrow) go to --screenshot-dir or $PLAYGROUND_SCREENSHOTS
(default: the test's temporary directory)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.server_process import REPO, ServerProcess

KEY = "playground-key"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                   reason="chromium and chromium-driver are not installed (Debian packages; "
                                          "`make test` installs them)")
# the page's default, and another model that comes before it alphabetically
DEFAULT_MODEL, OTHER_MODEL = "transformer-xl-stdlib", "adaptive-span-stdlib"
DOCUMENT = ("import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as handle:\n"
            "        return [line.rstrip() for line in handle]\n\n\n") * 28  # about 3 KB
# markup a page that used innerHTML would run or draw; the playground must show it as text
HOSTILE = '<img src=x onerror="window.hostile=1"><script>window.hostile=2</script>&amp;\n'
# characters of two, three and four bytes: each byte a token named by its escape ("<0xC3>"), whose
# name once counted as six bytes and was shown in place of the character
NON_ASCII = "# café — 漢字 𝄞\n"


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    # trained checkpoints, so that the memory's effect on the scores is real, and two of them, so
    # that the default model and the switch between models mean something: the other listed first,
    # as `xlserve serve` lists all of weights/ (alphabetically)
    models = [REPO / "weights" / OTHER_MODEL, REPO / "weights" / DEFAULT_MODEL]
    server = ServerProcess(models, env={"XLSERVE_API_KEYS": KEY, "XLSERVE_MAX_TOKENS_LIMIT": "100000"},
                           log_path=tmp_path_factory.mktemp("logs") / "server.log").start()
    yield server
    server.stop()


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never fetch a driver or a browser
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1100", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def shots(request, tmp_path) -> Path:
    directory = Path(request.config.getoption("--screenshot-dir", default=None)
                     or os.environ.get("PLAYGROUND_SCREENSHOTS") or tmp_path / "screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def wait_for(condition, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Page:
    """The playground in `browser`, by element id."""

    def __init__(self, browser):
        from selenium.webdriver.common.by import By

        self.browser, self.by = browser, By

    def find(self, element_id: str):
        return self.browser.find_element(self.by.ID, element_id)

    def text(self, element_id: str) -> str:
        return self.find(element_id).text

    def content(self, element_id: str) -> str:  # textContent: what is there, shown or not
        return self.browser.execute_script("return document.getElementById(arguments[0]).textContent;", element_id)

    def value(self, element_id: str) -> str:
        return self.browser.execute_script("return document.getElementById(arguments[0]).value;", element_id)

    def set_value(self, element_id: str, value) -> None:
        self.browser.execute_script("document.getElementById(arguments[0]).value = arguments[1];", element_id, str(value))

    def choose(self, element_id: str, value: str) -> None:
        from selenium.webdriver.support.ui import Select

        Select(self.find(element_id)).select_by_value(value)

    def open(self, server) -> None:
        from selenium.webdriver.common.keys import Keys

        self.browser.get(server.url + "/")
        assert self.browser.current_url.endswith("/playground")
        self.find("api-key").send_keys(KEY, Keys.TAB)  # the change event loads the models with the key
        wait_for(lambda: self.browser.execute_script("return document.getElementById('model').options.length") > 0,
                 what="the model list")


# Records the canvas's drawing calls (which context method, with which stroke style, text and
# alignment), so the test checks what was drawn rather than what the page says it drew.
RECORD_CANVAS = """
window.canvasCalls = [];
const proto = CanvasRenderingContext2D.prototype;
for (const name of ["clearRect", "stroke", "fillText"]) {
  const original = proto[name];
  proto[name] = function (...args) {
    window.canvasCalls.push({ call: name, strokeStyle: String(this.strokeStyle), textAlign: this.textAlign,
                              text: name === "fillText" ? String(args[0]) : null });
    return original.apply(this, args);
  };
}
"""


def hex_colour(css: str) -> str:
    red, green, blue = (int(part) for part in re.findall(r"\d+", css)[:3])
    return f"#{red:02x}{green:02x}{blue:02x}"


def last_drawing(calls: list[dict]) -> list[dict]:
    """The calls since the canvas was last cleared: the chart as it is now."""
    cleared = max(i for i, call in enumerate(calls) if call["call"] == "clearRect")
    return calls[cleared + 1:]


def numbers(labels: list[str]) -> list[float]:
    return [float(label[:-1]) * 1000 if label.endswith("k") else float(label) for label in labels]


@needs_browser
def test_the_playground_generates_reads_a_document_and_moves_sessions(page_server, browser, shots):
    page = Page(browser)
    page.open(page_server)
    # the default model is the Transformer-XL, though another comes first; chunks of 128 bytes
    listed = browser.execute_script("return [...document.getElementById('model').options].map(o => o.value)")
    assert listed[0] == OTHER_MODEL and DEFAULT_MODEL in listed
    assert page.value("model") == DEFAULT_MODEL
    assert "transformer-xl" in page.text("model-card")
    assert page.value("chunk-bytes") == "128"
    browser.save_screenshot(str(shots / "01-loaded.png"))

    # generate over the websocket (authenticated by subprotocol), then stop it mid-stream
    page.set_value("prompt", "def main():\n")
    page.set_value("max-tokens", 50000)
    page.find("generate").click()
    wait_for(lambda: len(page.text("output")) > 50, what="streamed tokens")
    browser.save_screenshot(str(shots / "02-generating.png"))
    page.find("cancel").click()
    wait_for(lambda: page.find("generation-stats").get_attribute("data-finish") == "cancelled", what="the cancel")
    stopped = len(page.content("output"))
    time.sleep(0.5)
    assert len(page.content("output")) == stopped
    assert "tokens/s" in page.text("generation-stats") and "time to first token" in page.text("generation-stats")
    assert stopped < 50000
    browser.save_screenshot(str(shots / "03-cancelled.png"))

    # read a document (markup in it) into a session at the default chunk size, with the canvas recorded
    document = HOSTILE + NON_ASCII + DOCUMENT
    browser.execute_script(RECORD_CANVAS)
    page.set_value("document", document)
    page.find("read").click()
    wait_for(lambda: page.find("document-stats").get_attribute("data-done") == "true", timeout=300, what="the document")
    spans = browser.execute_script("return document.querySelectorAll('#coloured span').length")
    assert spans == len(document.encode())  # one span per byte token, each coloured by its surprisal
    assert page.content("coloured") == document  # the markup is text: nothing parsed, nothing run
    assert page.find("document-stats").get_attribute("data-bytes") == str(len(document.encode()))
    # each character in the span of its last byte's token, whole: none split into UTF-16 halves
    texts = browser.execute_script("return [...document.querySelectorAll('#coloured span')].map(s => s.textContent)")
    assert [text for text in texts if text and not text.isascii()] == list("é—漢字𝄞")
    assert browser.execute_script("return document.querySelectorAll('#coloured *:not(span)').length") == 0
    assert browser.execute_script("return window.hostile === undefined")
    curve = page.find("curve")
    assert int(curve.get_attribute("data-with-points")) > 1000 and int(curve.get_attribute("data-without-points")) > 1000
    stats = page.text("document-stats")
    with_memory, without_memory = (float(re.search(rf"{kind} memory ([\d.]+) bits/byte", stats).group(1))
                                   for kind in ("with", "without"))
    assert with_memory < without_memory, stats  # at 128-byte chunks the memory shows
    wait_for(lambda: page.text("session-tokens") == str(len(document.encode())), what="the session's token count")
    assert page.text("session-tier") in ("device", "host", "disk")
    assert page.text("session-model") == DEFAULT_MODEL

    # the chart: "without memory" drawn first, "with memory" over it, in the legend's colours
    calls = browser.execute_script("return window.canvasCalls")
    with_colour = hex_colour(browser.execute_script(
        "return getComputedStyle(document.querySelector('#legend .with')).color"))
    without_colour = hex_colour(browser.execute_script(
        "return getComputedStyle(document.querySelector('#legend .without')).color"))
    drawing = last_drawing(calls)
    curve_strokes = [call["strokeStyle"] for call in drawing
                     if call["call"] == "stroke" and call["strokeStyle"] in (with_colour, without_colour)]
    assert curve_strokes == [without_colour, with_colour], curve_strokes
    # ... on axes with numbered ticks, increasing, and their units
    labels = [call for call in drawing if call["call"] == "fillText"]
    numeric = [call for call in labels if re.fullmatch(r"[\d.]+k?", call["text"])]
    y_ticks = numbers([call["text"] for call in numeric if call["textAlign"] == "right"])
    x_ticks = numbers([call["text"] for call in numeric if call["textAlign"] == "center"])
    assert len(y_ticks) >= 3 and y_ticks == sorted(y_ticks) and y_ticks[0] == 0, y_ticks
    assert y_ticks[-1] >= max(with_memory, without_memory), y_ticks
    assert len(x_ticks) >= 3 and x_ticks == sorted(x_ticks) and x_ticks[0] == 0, x_ticks
    assert x_ticks[-1] <= len(document.encode()) < x_ticks[-1] * 2, x_ticks
    units = {call["text"] for call in labels} - {call["text"] for call in numeric}
    assert {"bits/byte", "bytes read"} <= units, units
    browser.save_screenshot(str(shots / "04-document.png"))

    # continue the document from the session: its own output, the Generate panel's left alone
    generated, generated_stats = page.content("output"), page.text("generation-stats")
    page.set_value("max-tokens", 24)
    page.set_value("temperature", 0)
    page.find("continue").click()
    wait_for(lambda: page.find("continuation-stats").get_attribute("data-finish") == "length", what="the continuation")
    assert page.content("continuation") and "tokens/s" in page.text("continuation-stats")
    assert page.content("output") == generated and page.text("generation-stats") == generated_stats
    assert page.find("generation-stats").get_attribute("data-finish") == "cancelled"
    wait_for(lambda: page.text("session-tokens") == str(len(document.encode()) + 24), what="the continued session")
    browser.execute_script("document.getElementById('continuation-stats').scrollIntoView({block: 'center'})")
    browser.save_screenshot(str(shots / "05-continued.png"))
    browser.execute_script("window.scrollTo(0, 0)")

    # export, then import: a new session with the same token count
    exported_id, tokens = page.text("session-id"), page.text("session-tokens")
    page.find("export-session").click()
    exported = wait_for(lambda: [p for p in browser.downloads.glob("*.safetensors")], what="the download")[0]
    assert exported.stat().st_size > 0
    browser.execute_script("document.getElementById('import-session').style.display = 'block';")
    page.find("import-session").send_keys(str(exported))
    wait_for(lambda: page.text("session-id") not in ("–", exported_id), what="the imported session")
    assert page.text("session-tokens") == tokens and page.text("session-model") == DEFAULT_MODEL
    browser.save_screenshot(str(shots / "06-imported.png"))

    # fork: a new session with the same history; delete: gone, on the server too
    imported_id = page.text("session-id")
    page.find("fork-session").click()
    wait_for(lambda: page.text("session-id") not in ("–", imported_id), what="the fork")
    forked_id = page.text("session-id")
    assert page.text("session-tokens") == tokens
    page.find("delete-session").click()
    wait_for(lambda: page.text("session-id") == "–", what="the delete")
    with page_server.client(headers={"Authorization": f"Bearer {KEY}"}) as http:
        assert http.get(f"/v1/sessions/{forked_id}").status_code == 404
        assert http.get(f"/v1/sessions/{imported_id}").json()["tokens"] == int(tokens)
    browser.save_screenshot(str(shots / "07-forked-and-deleted.png"))

    # everything the page loaded came from the server that served it
    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(name.startswith(page_server.url + "/") for name in resources), resources
    paint = browser.execute_script(
        "return performance.getEntriesByType('paint').map(e => [e.name, e.startTime])")
    (shots / "timings.json").write_text(json.dumps({"paint_ms": dict(paint), "resources": resources}, indent=2))


@needs_browser
def test_the_session_panel_names_the_model_and_picking_a_session_switches_to_it(page_server, browser, shots):
    page = Page(browser)
    page.open(page_server)
    page.choose("model", OTHER_MODEL)
    page.find("new-session").click()
    wait_for(lambda: page.text("session-id") != "–", what="the new session")
    other_session = page.text("session-id")
    assert page.text("session-model") == OTHER_MODEL
    assert page.value("session-list") == other_session

    # another model: the session is put aside, not used with a model it does not belong to
    page.choose("model", DEFAULT_MODEL)
    wait_for(lambda: page.text("session-id") == "–", what="the session put aside")
    assert "error" not in page.find("status").get_attribute("class")

    # picking it again from the list switches the model back, and generating on it works
    page.choose("session-list", other_session)
    wait_for(lambda: page.text("session-id") == other_session, what="the picked session")
    assert page.value("model") == OTHER_MODEL and page.text("session-model") == OTHER_MODEL
    assert "put aside" not in page.text("status")
    assert OTHER_MODEL.split("-stdlib")[0] in page.text("model-card")
    page.set_value("prompt", "ab")
    page.set_value("max-tokens", 5)
    browser.execute_script("document.getElementById('use-session').checked = true;")
    page.find("generate").click()
    wait_for(lambda: page.find("generation-stats").get_attribute("data-finish"), what="the generation")
    assert page.find("generation-stats").get_attribute("data-finish") == "length", page.text("generation-stats")
    wait_for(lambda: page.text("session-tokens") == "7", what="the session's tokens (2 prompt bytes, 5 generated)")
    browser.save_screenshot(str(shots / "08-session-switches-model.png"))


# the properties that make a control look like a button (size, type, box, colours)
BUTTON_LOOK = ("display", "box-sizing", "font-family", "font-size", "font-weight", "line-height", "color",
               "background-color", "border-top-width", "border-top-style", "border-top-color", "border-radius",
               "padding-top", "padding-right", "padding-bottom", "padding-left", "cursor")


@needs_browser
def test_the_import_button_looks_like_the_other_buttons(page_server, browser):
    page = Page(browser)
    page.open(page_server)
    # every control measured in one script, at one moment: the session list fills in while the
    # page settles and moves the whole panel down, so two separate measurements can disagree
    looks = browser.execute_script(
        "return arguments[0].map(id => { const element = document.getElementById(id);"
        " const style = getComputedStyle(element); const box = element.getBoundingClientRect();"
        " return [Object.fromEntries(arguments[1].map(p => [p, style.getPropertyValue(p)])), box.height, box.top]; });",
        ["import-button", "export-session", "new-session", "delete-session"], list(BUTTON_LOOK))
    (imported, imported_height, imported_top), *others = looks
    for other, (style, height, top) in zip(("export-session", "new-session", "delete-session"), others):
        assert imported == style, (other, {p: (imported[p], style[p]) for p in BUTTON_LOOK if imported[p] != style[p]})
        assert abs(imported_height - height) < 1, other
        if other == "export-session":  # its neighbour in the row: level with it, unless the row wrapped
            # between them (the panel's width decides where the row wraps); never a few pixels off,
            # which a label styled unlike a button would be
            assert abs(imported_top - top) < 1 or imported_top - top >= height, (imported_top, top, height)


@needs_browser
def test_a_narrow_window_stacks_the_panels(page_server, browser, shots):
    page = Page(browser)
    browser.set_window_size(420, 1000)
    page.open(page_server)
    assert browser.execute_script("return window.innerWidth") <= 420
    page.set_value("document", DOCUMENT[:600])
    page.find("read").click()
    wait_for(lambda: page.find("document-stats").get_attribute("data-done") == "true", timeout=120, what="the document")
    boxes = browser.execute_script(
        "return ['generate-panel', 'document-panel', 'session-panel'].map(id => {"
        "  const box = document.getElementById(id).getBoundingClientRect();"
        "  return {left: box.left, top: box.top, bottom: box.bottom, width: box.width}; })")
    page_width = browser.execute_script("return document.documentElement.clientWidth")
    # one column: the same left edge and width, each panel below the one before, nearly the page's width
    assert len({round(box["left"]) for box in boxes}) == 1, boxes
    assert len({round(box["width"]) for box in boxes}) == 1, boxes
    assert all(before["bottom"] <= after["top"] for before, after in zip(boxes, boxes[1:])), boxes
    assert boxes[2]["width"] >= 0.9 * page_width, (boxes, page_width)
    # nothing sticks out sideways
    assert browser.execute_script("return document.documentElement.scrollWidth") <= page_width
    assert browser.execute_script("return document.getElementById('curve').getBoundingClientRect().right") <= page_width
    browser.save_screenshot(str(shots / "09-narrow-top.png"))
    browser.execute_script("document.getElementById('curve').scrollIntoView()")
    browser.save_screenshot(str(shots / "10-narrow-chart.png"))
    browser.execute_script("document.getElementById('session-panel').scrollIntoView()")
    browser.save_screenshot(str(shots / "11-narrow-session.png"))


def subprotocol(key: str) -> str:
    return "xlserve.key." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_a_browser_authenticates_the_websocket_with_a_subprotocol(page_server):
    """The key as the xlserve.key. subprotocol opens the websocket; the server accepts "xlserve",
    never echoing the key; a wrong key is refused like a wrong header."""
    from websockets.sync.client import connect

    url = page_server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url, subprotocols=["xlserve", subprotocol(KEY)]) as ws:
        assert ws.subprotocol == "xlserve"
        ws.send(json.dumps({"type": "generate", "id": "g", "model": DEFAULT_MODEL, "prompt": "x", "max_tokens": 3}))
        frames = [json.loads(ws.recv(timeout=30)) for _ in range(4)]
        assert [f["type"] for f in frames] == ["token", "token", "token", "done"]
    for offered in (["xlserve", subprotocol("wrong")], ["xlserve"], ["xlserve", "xlserve.key.%%%"]):
        with connect(url, subprotocols=offered) as ws:
            frame = json.loads(ws.recv(timeout=30))
            assert frame["type"] == "error" and frame["error"]["type"] == "authentication_error", offered
    with page_server.client() as http:  # the page itself needs no key; the API behind it does
        assert http.get("/playground").status_code == 200
        assert http.get("/v1/models").status_code == 401
    log = page_server.log_path.read_text()
    assert KEY not in log and subprotocol(KEY) not in log


@needs_browser
def test_a_generation_refused_for_its_key_says_why_and_a_new_key_opens_a_new_socket(page_server, browser):
    """The server refuses a websocket with a wrong key in an error frame that names no request: the
    page dropped it and showed only "connection closed". And a socket opened with one key went on
    being used after the key changed."""
    from selenium.webdriver.common.keys import Keys

    page = Page(browser)
    page.open(page_server)
    page.set_value("prompt", "def main():\n")
    page.set_value("max-tokens", 5)
    page.find("generate").click()
    wait_for(lambda: page.find("generation-stats").get_attribute("data-finish") == "length", what="a generation")
    key = page.find("api-key")
    key.clear()
    key.send_keys("wrong", Keys.TAB)  # the change event: the open socket carried the right key
    page.find("generate").click()
    wait_for(lambda: "API key" in page.text("generation-stats"), what="the refusal's reason")
