"""Open every page of the built docs site in headless Chromium and fail on what a reader would see broken.

Usage: python tools/check_site.py build/site [--shots build/site-shots] [--browser /usr/bin/chromium]

For each HTML page of the site (served from a local HTTP server on 127.0.0.1) it checks:
  * the page loads with HTTP 200 and has a non-empty <h1>;
  * no console error and no uncaught page error;
  * no request fails (a missing stylesheet, script or image) and no response is 4xx/5xx;
  * every <img> has loaded (naturalWidth > 0);
  * every link to another page of the site points at a page that exists;
and takes a full-page screenshot into --shots. Exit status 1 with one line per problem, 0 when clean.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import urljoin, urlparse


def pages(site: Path) -> list[str]:
    """Site-relative URLs of every HTML page, index pages as their folder."""
    out = []
    for html in sorted(site.rglob("*.html")):
        rel = html.relative_to(site).as_posix()
        if rel == "404.html":
            continue
        out.append(rel[: -len("index.html")] if rel.endswith("index.html") else rel)
    return out


def exists(site: Path, path: str) -> bool:
    target = site / path.lstrip("/")
    return target.is_file() or (target / "index.html").is_file()


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


def find_browser(explicit: str | None) -> str | None:
    for candidate in (explicit, "chromium", "chromium-browser", "google-chrome"):
        if candidate and (shutil.which(candidate) or Path(candidate).is_file()):
            return shutil.which(candidate) or candidate
    return None


def check(site: Path, shots: Path, browser: str) -> list[str]:
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    server, root = serve(site)
    shots.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as pw:
            chrome = pw.chromium.launch(executable_path=browser, args=["--no-sandbox"])
            page = chrome.new_page(viewport={"width": 1280, "height": 900})
            current: dict[str, str] = {"url": ""}

            def problem(text: str) -> None:
                problems.append(f"{current['url']}: {text}")

            page.on("console", lambda msg: msg.type == "error" and problem(f"console error: {msg.text}"))
            page.on("pageerror", lambda exc: problem(f"page error: {exc}"))
            page.on("requestfailed", lambda req: problem(f"request failed: {req.url} ({req.failure})"))
            page.on("response", lambda resp: resp.status >= 400 and problem(f"HTTP {resp.status}: {resp.url}"))
            for rel in pages(site):
                current["url"] = rel or "/"
                response = page.goto(root + rel, wait_until="load")
                if response is None or response.status != 200:
                    problem(f"status {response.status if response else 'none'}")
                    continue
                heading = page.eval_on_selector_all("h1", "els => els.map(e => e.textContent.trim())")
                if not any(heading):
                    problem("no <h1> heading")
                broken = page.eval_on_selector_all(
                    "img", "els => els.filter(e => !(e.complete && e.naturalWidth > 0)).map(e => e.src)")
                for src in broken:
                    problem(f"image did not load: {src}")
                for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))"):
                    url = urlparse(urljoin(root + rel, href))
                    if url.netloc == urlparse(root).netloc and not exists(site, url.path):
                        problem(f"link to a missing page: {href}")
                name = (rel.strip("/").replace("/", "_") or "index").removesuffix(".html")
                page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
            chrome.close()
    finally:
        server.shutdown()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--shots", type=Path, default=None)
    parser.add_argument("--browser", default=None)
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"check_site: {args.site} has no index.html: run `make docs` first", file=sys.stderr)
        return 1
    browser = find_browser(args.browser)
    if browser is None:
        print("check_site: no Chromium found (install the Debian package chromium, or pass --browser)",
              file=sys.stderr)
        return 1
    shots = args.shots or args.site.parent / "site-shots"
    problems = check(args.site, shots, browser)
    for line in problems:
        print(line)
    print(f"check_site: {len(pages(args.site))} pages, {len(problems)} problems, screenshots in {shots}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
