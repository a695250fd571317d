"""/docs (Swagger UI) and /redoc (ReDoc) work offline: their pages name no other host, every
script, stylesheet and icon they load is served by xlserve itself (from the fastapi-offline
package, server/api/routers/docs.py), the pages and assets need no API key and stay open while
the models load, and a real browser (Debian's chromium, the playground test's fixtures) renders
the operations from /openapi.json, with and without API keys on the server. Screenshots go to
$DOCS_SCREENSHOTS (default: the test's temporary directory)."""

from __future__ import annotations

import os
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from starlette.testclient import TestClient

from xlserve.server.api.deps import AppState
from xlserve.server.api.routers.docs import ASSETS, DOCUMENTATION_PATHS
from xlserve.server.app import build_app
from xlserve.server.engine.errors import EngineLoading
from xlserve.server.metrics import Metrics
from xlserve.server.settings import Settings

# the playground's browser and keyed server, reused as they are (tests/e2e/test_playground.py)
from tests.e2e.test_playground import KEY, browser, needs_browser, page_server, wait_for  # noqa: F401

PAGES = ("/docs", "/redoc")


class References(HTMLParser):
    """Every URL a page's tags load: src and href attributes, and ReDoc's spec-url."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href", "spec-url") and value]


def references(html: str) -> list[str]:
    parser = References()
    parser.feed(html)
    return parser.urls


class LoadingEngine:
    """The engine client while the engine process loads the models, as far as LoadingGate asks."""

    def unavailable_error(self) -> BaseException:
        return EngineLoading("the server is still loading its models; retry shortly", code="loading")


@pytest.fixture
def loading_client():
    """The app as `xlserve serve` has it before the models are loaded, with API keys: the pages
    and their assets answer, every API route gets 503 `loading`. The client is not entered: no
    lifespan, no engine process."""
    settings = Settings(models="none-loaded", api_keys="secret")
    app = build_app(settings)
    state = AppState(settings=settings, metrics=Metrics(), api_keys=["secret"])
    state.engine = LoadingEngine()
    app.state.xlserve = state
    client = TestClient(app)  # not entered: no lifespan
    yield client
    client.close()


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_name_no_other_host_and_load_only_our_assets(page, loading_client):
    response = loading_client.get(page)  # no key, and the models still loading
    assert response.status_code == 200, response.text
    html = response.text
    assert not re.search(r"(https?:)?//[A-Za-z0-9]", html), f"{page} names another host: " + \
        str(re.findall(r"(?:https?:)?//[^\s'\"<>]+", html))
    loaded = references(html)
    assert loaded, f"{page} loads nothing?"
    for url in loaded:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), f"{page} loads {url}"
        assert url in DOCUMENTATION_PATHS or url == "/openapi.json", f"{page} loads {url}, which xlserve does not serve"
    scripts = [url for url in loaded if url.endswith(".js")]
    assert len(scripts) == 1, scripts  # the bundle that renders the page
    # and the browser may load or ask nothing from elsewhere (ReDoc's bundle names a logo on a CDN)
    policy = dict(directive.strip().split(" ", 1) for directive in
                  response.headers["content-security-policy"].split(";"))
    for directive in ("default-src", "script-src", "style-src", "img-src", "font-src", "connect-src"):
        assert "'self'" in policy[directive].split(), directive
        assert not [source for source in policy[directive].split() if "." in source or source in ("*", "https:", "http:")]


def test_every_asset_is_served_without_a_key_while_loading(loading_client):
    for path, (name, media_type) in ASSETS.items():
        response = loading_client.get(path)
        assert response.status_code == 200, (path, response.status_code, response.text[:200])
        assert response.headers["content-type"] == media_type
        assert len(response.content) > 1000, path  # the real file, not an empty stand-in
        assert response.headers["x-content-type-options"] == "nosniff"
    bundle = loading_client.get("/docs/assets/swagger-ui-bundle.js").text
    assert "SwaggerUIBundle" in bundle
    assert "Redoc" in loading_client.get("/docs/assets/redoc.standalone.js").text
    # the schema the pages render is open too; an API route is not
    assert loading_client.get("/openapi.json").status_code == 200
    assert loading_client.get("/v1/models").status_code == 503


def test_only_the_named_assets_are_served(loading_client):
    loading_client.app.state.xlserve.engine = None  # past the loading gate: an unknown path is a 404
    for path in ("/docs/assets/", "/docs/assets/../core.py", "/docs/assets/consts.py", "/docs/oauth2-redirect"):
        assert loading_client.get(path).status_code == 404, path
    # the pages are not API operations: the schema does not list them
    listed = loading_client.get("/openapi.json").json()["paths"]
    assert not [path for path in listed if path in DOCUMENTATION_PATHS]


# --- in a real browser, against a real server


def requests_elsewhere(browser, origin: str) -> list[str]:
    """Every resource the page asked for from another origin that the browser did not block by
    the page's Content-Security-Policy (none expected): ReDoc's bundle asks for its vendor's logo
    from a CDN, which the policy blocks before any request is sent."""
    entries = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => [e.name, e.transferSize, e.responseStatus])")
    blocked = " ".join(entry["message"] for entry in browser.get_log("browser")
                       if "Content Security Policy" in entry["message"] and "blocked" in entry["message"])
    return [name for name, size, status in entries
            if not name.startswith((origin + "/", "blob:", "data:")) and (f"'{name}'" not in blocked or size or status)]


@needs_browser
@pytest.mark.parametrize("keyed", [True, False], ids=["api-keys", "open"])
def test_swagger_ui_and_redoc_render_the_operations_in_a_browser(keyed, request, browser, tmp_path):
    from selenium.webdriver.common.by import By

    server = request.getfixturevalue("page_server" if keyed else "server")
    shots = Path(os.environ.get("DOCS_SCREENSHOTS", tmp_path / "screenshots"))
    shots.mkdir(parents=True, exist_ok=True)
    label = "keyed" if keyed else "open"

    browser.get(server.url + "/docs")
    # Swagger UI fetches /openapi.json and draws one block per operation, its path in data-path
    paths = wait_for(lambda: [element.get_attribute("data-path") for element in
                              browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")],
                     timeout=60, what="Swagger UI's operations")
    assert "/v1/completions" in paths and "/v1/sessions/{session_id}" in paths, paths
    assert "/v1/completions" in browser.find_element(By.ID, "swagger-ui").text
    assert browser.title == "xlserve - Swagger UI"
    assert requests_elsewhere(browser, server.url) == []
    browser.save_screenshot(str(shots / f"docs-{label}.png"))

    browser.get(server.url + "/redoc")
    # ReDoc draws each operation with its method and path in the right-hand panel
    wait_for(lambda: "/v1/completions" in browser.find_element(By.TAG_NAME, "body").text,
             timeout=60, what="ReDoc's operations")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert "/v1/sessions/{session_id}" in body
    assert browser.title == "xlserve - ReDoc"
    assert requests_elsewhere(browser, server.url) == []
    browser.save_screenshot(str(shots / f"redoc-{label}.png"))
