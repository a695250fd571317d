"""The playground: a page served by xlserve itself at /playground (and / redirects there).

Static files from server/api/playground/, installed with the package as package data and found
through `importlib.resources` (wherever the package is installed, not relative to this file):
plain HTML, CSS and JavaScript, no build step, nothing fetched from another origin. Only the
files named here are served (no directory listing, no path from the URL touches the file
system). The page asks the API with the key typed into it, which stays in the browser; the page
itself needs no key, like /docs.
"""

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

router = APIRouter()

# The package's data as its loader sees it. Every way xlserve is installed (a source tree, an
# editable install, a wheel unpacked into site-packages) gives a real directory here, which
# FileResponse needs to send a file with its ETag and Last-Modified.
PAGE_DIR = files("xlserve.server.api") / "playground"
FILES = {  # URL path -> (file, media type)
    "/playground": ("index.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset({"/", *FILES})  # open while the models load, as /docs is


def _serve(name: str, media_type: str):
    async def serve():
        # the page must not be framed by another site, and may only talk to this server
        return FileResponse(PAGE_DIR / name, media_type=media_type, headers={
            "Content-Security-Policy": "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' blob: data:; "
                                       "frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    return serve


for path, (name, media_type) in FILES.items():
    router.add_api_route(path, _serve(name, media_type), methods=["GET"], include_in_schema=False)


@router.get("/", include_in_schema=False)
async def root():
    return RedirectResponse("/playground")
