"""The dashboard: one HTML page, its script and its style sheet, shipped inside the package.

No CDN and no build step: the files below are everything the page loads, so it works on a
cluster with no outside network. They hold no secret and are served without the token (a
browser navigation cannot send a bearer header); the page asks for the token and sends it on
every API call it makes.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

FILES = {
    "/dashboard/app.js": ("app.js", "text/javascript"),
    "/dashboard/style.css": ("style.css", "text/css"),
}
PAGES = ("/", "/dashboard")
PATHS = frozenset(PAGES) | frozenset(FILES)


def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


def routes() -> list[web.RouteDef]:
    page = _read("index.html")
    assets = {path: (_read(name), kind) for path, (name, kind) in FILES.items()}

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    async def asset(request: web.Request) -> web.Response:
        body, kind = assets[request.path]
        return web.Response(body=body, content_type=kind, charset="utf-8")

    return [web.get(path, index) for path in PAGES] + [web.get(path, asset) for path in assets]
