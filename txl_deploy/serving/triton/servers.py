"""The Triton servers a client talks to: their addresses, one connection each, and which server a conversation
goes to (rendezvous hashing of its sequence id). client.py's docstring says how they are used."""

from __future__ import annotations

import hashlib
import secrets

from txl_deploy.errors import TxlError

LOST_RETRY_S = 30.0  # a server that could not be reached gets no new conversations for this long (if others can)


class ServingError(TxlError):
    """The server could not be reached, or refused a request."""


def split_url(url: str) -> tuple[str, str]:
    """'grpc://host:port' -> ('grpc', 'host:port'); a bare 'host:port' or http(s):// is HTTP."""
    url = url.strip()
    for scheme in ("grpc", "http"):
        if url.startswith(scheme + "://"):
            return scheme, url[len(scheme) + 3:].rstrip("/")
    if url.startswith("https://"):
        raise ServingError(f"{url}: https is not supported by this client; use http:// or grpc://")
    if "://" in url:
        raise ServingError(f"{url}: unknown scheme; use http://HOST:PORT or grpc://HOST:PORT")
    return "http", url.rstrip("/")


def new_sequence_id() -> int:
    """A random non-zero 63-bit id (Triton reserves 0 for 'no sequence'); collisions between clients are
    astronomically unlikely, so no coordination between load-balanced clients is needed."""
    return secrets.randbits(63) | 1


def rendezvous_order(key, urls) -> list[str]:
    """`urls` by rendezvous (highest-random-weight) score for `key`, best first. The score is a keyed hash of
    (server, key), so the order of a key's servers does not depend on which other servers exist: removing one
    moves only the keys whose best server it was, and each key's next server is its second best."""
    def score(url):
        digest = hashlib.blake2b(f"{url}\n{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(urls, key=score, reverse=True)


class Server:
    """One Triton server: its tritonclient connection and what the client knows about its health."""

    def __init__(self, url: str, model: str, timeout: float):
        self.url, self.timeout = url, timeout
        self.protocol, address = split_url(url)
        try:
            if self.protocol == "grpc":
                import tritonclient.grpc as tc  # optional (the triton extra)
            else:
                import tritonclient.http as tc  # optional (the triton extra)
        except ImportError as e:
            raise ServingError(f"the Triton client is not installed: pip install 'tritonclient[all]' ({e})") from None
        self.tc = tc
        try:
            if self.protocol == "grpc":
                self.client = tc.InferenceServerClient(address)
            else:
                self.client = tc.InferenceServerClient(address, connection_timeout=timeout, network_timeout=timeout)
        except Exception as e:  # bad address syntax
            raise ServingError(f"cannot connect to {url}: {first_line(e)}") from None
        self.draining = False
        self.lost_at = None  # monotonic time of the last failed contact
        self.lost_reason = None

    def close(self):
        try:
            self.client.close()
        except Exception:
            pass


def first_line(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__

