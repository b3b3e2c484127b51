"""Remote image URLs (``http(s)://`` in an ``image_url`` part), fetched only when the operator turns
them on (``Limits.allow_remote_media``, ``dasllama serve --allow-remote-media``; off by default: a
server that fetches what clients name can be pointed at hosts the client cannot reach).

A fetch follows redirects only to http(s), stops at ``remote_timeout_s`` (connect, each read and the
whole transfer), and at ``max_media_bytes`` (the Content-Length is checked first, then the bytes as
they come). Every failure is a 400 naming the URL's host and what went wrong.
"""
from __future__ import annotations

import time
import urllib.error
import urllib.parse
import urllib.request

from .protocol import APIError, Limits, bad

SCHEMES = ("http", "https")


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in SCHEMES:
            raise urllib.error.URLError(f"a redirect to a non-http(s) URL ({newurl.split(':', 1)[0]}:)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def is_remote(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme.lower() in SCHEMES


def fetch_image(url: str, limits: Limits, budget: int) -> bytes:
    """The bytes at ``url`` (at most ``budget`` of them), or an APIError 400."""
    host = urllib.parse.urlsplit(url).hostname or "?"
    what = f"image_url: fetching {host}"
    if not is_remote(url):
        raise bad(f"image_url: only http(s) URLs are fetched", "messages")
    cap = min(int(budget), limits.max_media_bytes)
    if cap <= 0:
        raise bad(f"the request's media are over the {limits.max_media_bytes} byte limit", "messages")
    deadline = time.monotonic() + limits.remote_timeout_s
    opener = urllib.request.build_opener(_HttpOnlyRedirects())
    req = urllib.request.Request(url, headers={"User-Agent": "dasllama", "Accept": "image/*"})
    try:
        with opener.open(req, timeout=limits.remote_timeout_s) as r:
            n = r.headers.get("Content-Length")
            if n is not None and n.isdigit() and int(n) > cap:
                raise bad(f"{what}: the image is {int(n)} bytes, over the limit of {cap}", "messages")
            out = bytearray()
            while True:
                if time.monotonic() > deadline:
                    raise bad(f"{what}: no whole image within {limits.remote_timeout_s:g} s", "messages")
                chunk = r.read(min(1 << 16, cap + 1 - len(out)))
                if not chunk:
                    break
                out += chunk
                if len(out) > cap:
                    raise bad(f"{what}: the image is over the limit of {cap} bytes", "messages")
            return bytes(out)
    except APIError:
        raise
    except urllib.error.HTTPError as e:
        raise bad(f"{what}: HTTP {e.code} {e.reason}", "messages") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            raise bad(f"{what}: no whole image within {limits.remote_timeout_s:g} s", "messages") from None
        raise bad(f"{what}: {reason}", "messages") from None
