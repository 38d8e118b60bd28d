"""Opening a page in headless Chromium over the DevTools protocol, for the browser driver (helpers.browser)."""

from __future__ import annotations

import time


def open_page(send, evaluate, url: str, timeout: float = 120.0):
    """Navigate to `url` and wait until the page has set up `window.txlDemo`, then return its `ready` promise's value.

    The page being left is marked first, so the wait never mistakes it for the new one (both define txlDemo),
    and an evaluation that meets the old document as it goes away is asked again rather than failing."""
    try:
        evaluate("window.__txlLeft = true")
    except RuntimeError:
        pass  # nothing loaded yet
    send("Page.navigate", url=url)
    end = time.monotonic() + timeout
    while True:
        try:
            if evaluate("!window.__txlLeft && typeof window.txlDemo === 'object'"):
                return evaluate("window.txlDemo.ready")
        except RuntimeError:  # "Execution context was destroyed": the navigation replaced the document meanwhile
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{url}: the page did not start: {evaluate('document.body.innerText')}")
        time.sleep(0.1)
