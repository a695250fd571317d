"""The API reference pages, /docs (Swagger UI) and /redoc (ReDoc), with every asset served by
xlserve itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so offline (or behind a firewall) they
are blank. Here the pages are FastAPI's (`get_swagger_ui_html`, `get_redoc_html`) pointed at
the files the `fastapi-offline` package ships (swagger-ui-bundle.js, swagger-ui.css,
redoc.standalone.js, a favicon; MIT, Swagger UI's and ReDoc's own licences inside the bundles),
found through `importlib.resources` wherever that package is installed. Only the files named
here are served. Swagger UI's online validator (a request to another host) is turned off, ReDoc
does not load Google's fonts, and a Content-Security-Policy lets the pages load and ask only
this server (`PAGE_POLICY`). Like the playground, the pages need no API key.
"""

from importlib.resources import files

import fastapi_offline
from fastapi import APIRouter
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse

SWAGGER_PATH, REDOC_PATH, OPENAPI_PATH = "/docs", "/redoc", "/openapi.json"
ASSET_DIR = files(fastapi_offline) / "static"  # a real directory wherever the package is installed
ASSETS = {  # URL path -> (file, media type)
    "/docs/assets/swagger-ui-bundle.js": ("swagger-ui-bundle.js", "text/javascript; charset=utf-8"),
    "/docs/assets/swagger-ui.css": ("swagger-ui.css", "text/css; charset=utf-8"),
    "/docs/assets/redoc.standalone.js": ("redoc.standalone.js", "text/javascript; charset=utf-8"),
    "/docs/assets/favicon.png": ("favicon.png", "image/png"),
}
# open while the models load and needing no key, as the playground's pages
DOCUMENTATION_PATHS = frozenset({SWAGGER_PATH, REDOC_PATH, *ASSETS})
# The pages may load and ask only this server. Swagger UI's page starts it with an inline script,
# and both libraries inject inline styles; ReDoc's bundle still draws a logo from its vendor's
# CDN in its menu (an <img> it hides when it fails to load), which this keeps the browser from
# even requesting.
PAGE_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
               "img-src 'self' data: blob:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
               "frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": PAGE_POLICY, "X-Content-Type-Options": "nosniff"}


def documentation_router(title: str) -> APIRouter:
    """The two pages, titled after the app, and their assets."""
    router = APIRouter()

    @router.get(SWAGGER_PATH, include_in_schema=False)
    async def swagger_ui():
        page = get_swagger_ui_html(
            openapi_url=OPENAPI_PATH, title=f"{title} - Swagger UI",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js", swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon.png",
            # null: no badge that sends the document to swagger.io's validator
            swagger_ui_parameters={"validatorUrl": None})
        page.headers.update(PAGE_HEADERS)
        return page

    @router.get(REDOC_PATH, include_in_schema=False)
    async def redoc():
        page = get_redoc_html(openapi_url=OPENAPI_PATH, title=f"{title} - ReDoc",
                              redoc_js_url="/docs/assets/redoc.standalone.js",
                              redoc_favicon_url="/docs/assets/favicon.png", with_google_fonts=False)
        page.headers.update(PAGE_HEADERS)
        return page

    def serve(name: str, media_type: str):
        async def asset():
            # the bundles change only with the package: a browser may keep them, revalidating
            return FileResponse(ASSET_DIR / name, media_type=media_type,
                                headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

        return asset

    for path, (name, media_type) in ASSETS.items():
        router.add_api_route(path, serve(name, media_type), methods=["GET"], include_in_schema=False)
    return router
