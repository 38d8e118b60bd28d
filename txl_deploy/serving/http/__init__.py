"""`txl-deploy serve`: an OpenAI-compatible HTTP API over one model, with sessions that keep a memory.

`protocol` the wire format, `completion` one request's sampling and text, `sessions` the session store, `scheduler`
continuous batching over one batched runtime (no HTTP), `fleet` the same engine interface over Triton servers,
`metrics` Prometheus, `app` the FastAPI app, `server` uvicorn. Needs the `serve` extra (FastAPI, uvicorn,
sse-starlette, prometheus-client): nothing outside this package imports it at module level.
"""
