"""The playground page in a real browser (Debian's chromium through chromium-driver and Selenium,
nothing downloaded) against a real server with an API key: the key typed into the page
authenticates HTTP and the websocket (as a subprotocol), generation streams and stops on cancel,
a document of a few KB is read into a session, coloured by surprisal with both curves drawn,
the session panel shows the right token count, and export then import gives a session with the
same count. The page loads nothing from another origin. Screenshots of every step go to
$PLAYGROUND_SCREENSHOTS (default: the test's temporary directory)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.server_process import ServerProcess

KEY = "playground-key"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
needs_browser = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                   reason="chromium and chromium-driver are not installed (Debian packages; "
                                          "`make test` installs them)")
DOCUMENT = ("import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as handle:\n"
            "        return [line.rstrip() for line in handle]\n\n\n") * 28  # about 3 KB


@pytest.fixture(scope="module")
def page_server(tiny_checkpoint, tmp_path_factory):
    # PLAYGROUND_MODEL: another checkpoint to drive the page with (a shipped one, for screenshots)
    checkpoint = os.environ.get("PLAYGROUND_MODEL") or tiny_checkpoint
    server = ServerProcess([checkpoint], env={"XLSERVE_API_KEYS": KEY, "XLSERVE_MAX_TOKENS_LIMIT": "100000"},
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


def wait_for(condition, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@needs_browser
def test_the_playground_generates_reads_a_document_and_moves_sessions(page_server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    shots = Path(os.environ.get("PLAYGROUND_SCREENSHOTS", tmp_path / "screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    find = lambda element_id: browser.find_element(By.ID, element_id)  # noqa: E731
    text = lambda element_id: find(element_id).text  # noqa: E731

    def set_value(element_id: str, value) -> None:
        browser.execute_script("document.getElementById(arguments[0]).value = arguments[1];", element_id, str(value))

    browser.get(page_server.url + "/")
    assert browser.current_url.endswith("/playground")
    key = find("api-key")
    key.send_keys(KEY, Keys.TAB)  # the change event loads the models with the key
    wait_for(lambda: browser.execute_script("return document.getElementById('model').options.length") > 0,
             what="the model list")
    assert "transformer-xl" in text("model-card")
    browser.save_screenshot(str(shots / "01-loaded.png"))

    # generate over the websocket (authenticated by subprotocol), then stop it mid-stream
    set_value("prompt", "def main():\n")
    set_value("max-tokens", 50000)
    find("generate").click()
    wait_for(lambda: len(text("output")) > 50, what="streamed tokens")
    browser.save_screenshot(str(shots / "02-generating.png"))
    find("cancel").click()
    wait_for(lambda: find("generation-stats").get_attribute("data-finish") == "cancelled", what="the cancel")
    stopped = len(browser.execute_script("return document.getElementById('output').textContent"))
    time.sleep(0.5)
    assert len(browser.execute_script("return document.getElementById('output').textContent")) == stopped
    assert "tokens/s" in text("generation-stats") and "time to first token" in text("generation-stats")
    assert stopped < 50000
    browser.save_screenshot(str(shots / "03-cancelled.png"))

    # read a document into a session, scored, with and without memory
    set_value("document", DOCUMENT)
    set_value("chunk-bytes", 1024)
    find("read").click()
    wait_for(lambda: find("document-stats").get_attribute("data-done") == "true", timeout=180, what="the document")
    spans = browser.execute_script("return document.querySelectorAll('#coloured span').length")
    assert spans == len(DOCUMENT.encode())  # one span per byte token, each coloured by its surprisal
    curve = find("curve")
    assert int(curve.get_attribute("data-with-points")) > 1000 and int(curve.get_attribute("data-without-points")) > 1000
    assert "with memory" in text("document-stats") and "without memory" in text("document-stats")
    wait_for(lambda: text("session-tokens") == str(len(DOCUMENT.encode())), what="the session's token count")
    assert text("session-tier") in ("device", "host", "disk")
    browser.save_screenshot(str(shots / "04-document.png"))

    # continue the document from the session
    set_value("max-tokens", 24)
    set_value("temperature", 0)
    find("continue").click()
    wait_for(lambda: find("generation-stats").get_attribute("data-finish") == "length", what="the continuation")
    wait_for(lambda: text("session-tokens") == str(len(DOCUMENT.encode()) + 24), what="the continued session")
    browser.save_screenshot(str(shots / "05-continued.png"))

    # export, then import: a new session with the same token count
    exported_id, tokens = text("session-id"), text("session-tokens")
    find("export-session").click()
    exported = wait_for(lambda: [p for p in browser.downloads.glob("*.safetensors")], what="the download")[0]
    assert exported.stat().st_size > 0
    browser.execute_script("document.getElementById('import-session').style.display = 'block';")
    find("import-session").send_keys(str(exported))
    wait_for(lambda: text("session-id") not in ("–", exported_id), what="the imported session")
    assert text("session-tokens") == tokens
    browser.save_screenshot(str(shots / "06-imported.png"))

    # fork: a new session with the same history; delete: gone, on the server too
    imported_id = text("session-id")
    find("fork-session").click()
    wait_for(lambda: text("session-id") not in ("–", imported_id), what="the fork")
    forked_id = text("session-id")
    assert text("session-tokens") == tokens
    find("delete-session").click()
    wait_for(lambda: text("session-id") == "–", what="the delete")
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


def subprotocol(key: str) -> str:
    return "xlserve.key." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_a_browser_authenticates_the_websocket_with_a_subprotocol(page_server):
    """The key as the xlserve.key. subprotocol opens the websocket; the server accepts "xlserve",
    never echoing the key; a wrong key is refused like a wrong header."""
    from websockets.sync.client import connect

    url = page_server.url.replace("http://", "ws://") + "/v1/stream"
    with connect(url, subprotocols=["xlserve", subprotocol(KEY)]) as ws:
        assert ws.subprotocol == "xlserve"
        model = Path(os.environ.get("PLAYGROUND_MODEL") or "txl-tiny").name
        ws.send(json.dumps({"type": "generate", "id": "g", "model": model, "prompt": "x", "max_tokens": 3}))
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
