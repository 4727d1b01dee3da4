"""The server's images: the URLs of a request's image parts (chat completions' image_url, the Responses API's
input_image) turned into checked image file bytes, off the event loop.

    data = load_images(urls, settings)   # in a worker thread: list of bytes, or a one-line ValueError

A data URL (data:image/png;base64,...) is decoded with strict base64. A remote http(s) URL is refused unless its host
is one of the operator's --allowed-media-domains (or a subdomain of one); it is then fetched with httpx, within a
size cap and a timeout, only from public addresses (each hop's host is resolved and every address checked: never a
private, loopback, link-local or reserved one), following at most a few redirects, each to the same host. Every
image is then decoded once with Pillow (images.open_image), which refuses non-images, bombs and truncated files.
"""
from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from redline.images import MAX_IMAGE_BYTES, open_image

# Images one request may carry, and the whole wait for one remote image.
MAX_IMAGES_PER_REQUEST = 8
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
DATA_URL = re.compile(r"data:(image/(?:png|jpeg|jpg|webp|gif));base64,(.*)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class MediaSettings:
    """Where a request's images may come from (ServeSettings.media)."""

    allowed_domains: tuple[str, ...] = ()  # hosts remote image URLs may name (and their subdomains); () none
    max_images: int = MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = MAX_IMAGE_BYTES

    def __post_init__(self) -> None:
        domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_domains)
        if not all(d and "/" not in d and ":" not in d and " " not in d for d in domains):
            raise ValueError(f"--allowed-media-domains takes host names separated by commas (example.com,cdn.org), "
                             f"got {','.join(self.allowed_domains)}")
        object.__setattr__(self, "allowed_domains", domains)
        if self.max_images < 1 or self.max_image_bytes < 1:
            raise ValueError("the image limits must be positive")

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


def load_images(urls: Sequence[str], settings: MediaSettings) -> list[bytes]:
    """Each URL's image file bytes, checked to decode as an image; ValueError naming the image and the problem."""
    if len(urls) > settings.max_images:
        raise ValueError(f"the request has {len(urls)} images, more than the {settings.max_images} allowed; send "
                         f"fewer")
    out = []
    for i, url in enumerate(urls):
        try:
            data = image_url_bytes(url, settings)
            open_image(data)  # non-images, bombs, truncated files: refused here, in bounded time and memory
        except ValueError as exc:
            raise ValueError(f"image {i + 1}: {exc}") from None
        out.append(data)
    return out


def image_url_bytes(url: str, settings: MediaSettings) -> bytes:
    if url[:5].lower() == "data:":
        return data_url_bytes(url, settings.max_image_bytes)
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError("an image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL")
    if not settings.allowed_domains:
        raise ValueError("this server fetches no remote images; send the image inline as a data: URL (or start the "
                         "server with --allowed-media-domains)")
    return fetch_image(url, settings)


def data_url_bytes(url: str, limit: int) -> bytes:
    match = DATA_URL.fullmatch(url)
    if match is None:
        raise ValueError("a data URL must read data:image/(png|jpeg|webp|gif);base64,<data>")
    text = re.sub(r"\s+", "", match.group(2))
    if len(text) // 4 * 3 > limit + 3:
        raise ValueError(f"the image is larger than the {limit} bytes allowed; send a smaller one")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's base64 is malformed") from None


def public_host(host: str, port: int) -> None:
    """Refuse a host any of whose addresses is not a public one (loopback, private, link-local, reserved, ...)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ValueError(f"the image host {host} does not resolve") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global or address.is_multicast:
            raise ValueError(f"the image host {host} resolves to {address}, which is not a public address; this "
                             f"server fetches images only from public addresses")


def fetch_image(url: str, settings: MediaSettings) -> bytes:
    """The bytes at a remote URL on an allowed domain, fetched within the size cap and the timeout."""
    import httpx

    first = urlsplit(url).hostname or ""
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme.lower() not in ("http", "https") or not host:
            raise ValueError("an image URL must be an http(s) URL with a host")
        if not settings.allows(host):
            raise ValueError(f"the image host {host} is not among the server's --allowed-media-domains")
        if host.lower() != first.lower():
            raise ValueError(f"the image URL redirects to another host ({host}); give the final URL")
        public_host(host, parts.port or (443 if parts.scheme.lower() == "https" else 80))
        try:
            with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers.get("location", ""))
                    continue
                if response.status_code != 200:
                    raise ValueError(f"fetching the image gave HTTP {response.status_code}")
                return capped_body(response, settings.max_image_bytes, time.monotonic() + FETCH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise ValueError(f"the image could not be fetched ({type(exc).__name__})") from None
    raise ValueError(f"the image URL redirects more than {MAX_REDIRECTS} times")


def capped_body(response: object, limit: int, deadline: float) -> bytes:
    """The response's body, refused past `limit` bytes or the `deadline` (a slow trickle ends too)."""
    chunks, size = [], 0
    for chunk in response.iter_bytes():  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise ValueError(f"fetching the image took longer than {FETCH_TIMEOUT_S:g} s")
        size += len(chunk)
        if size > limit:
            raise ValueError(f"the image is larger than the {limit} bytes allowed; send a smaller one")
        chunks.append(chunk)
    return b"".join(chunks)
