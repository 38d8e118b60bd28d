"""The outermost ASGI layer of `txl-deploy serve`: the API key and the body bound, checked before the app (and
before any of the body is read), and every request counted by endpoint and status."""

from __future__ import annotations

import hmac
import json
from typing import Callable

from txl_deploy.serving.http.metrics import Metrics, endpoint_label
from txl_deploy.serving.http.protocol import ApiError, error_body


class Guard:
    """Outermost ASGI layer: checks the API key on /v1 (401 before any of the body is read), bounds every request
    body (413 before the app sees it) and counts requests by endpoint (the route's template) and status. The body is
    read here, up to the bound, and replayed to the app; later receives (the client's disconnect) pass through."""

    def __init__(self, app, settings, metrics: Metrics, state_limit: Callable[[], int]):
        self.app, self.settings, self.metrics, self.state_limit = app, settings, metrics, state_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = endpoint_label(self.app.router.routes, scope)
        limit = self.state_limit() if endpoint.endswith("/restore") else self.settings.max_body_bytes
        status = {"code": 500}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            key = self.settings.api_key
            guarded = path == "/v1" or path.startswith("/v1/")
            if guarded and key is not None and not key_matches(dict(scope["headers"]).get(b"authorization", b""), key):
                return await send_json(counted_send, 401, key_error().body(), {"WWW-Authenticate": "Bearer"})
            body = bytearray()
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                return await self._too_large(counted_send, limit)
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    status["code"] = 499
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > limit:
                    return await self._too_large(counted_send, limit)
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
                return await receive()

            await self.app(scope, replay, counted_send)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()

    async def _too_large(self, send, limit):
        await send_json(send, 413, error_body(f"the request body is larger than this server accepts ({limit:,} "
                                               "bytes)", code="request_too_large"))


async def send_json(send, status: int, content: dict, headers: dict | None = None):
    body = json.dumps(content).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def key_error() -> ApiError:
    return ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>", type="authentication_error",
                    code="invalid_api_key")


def key_matches(header: bytes, api_key: str) -> bool:
    """Whether an Authorization header's value is `Bearer <api_key>`. The key is compared in constant time, so how
    long a refusal takes says nothing about how much of a guess was right."""
    scheme, _, key = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), api_key.encode())
