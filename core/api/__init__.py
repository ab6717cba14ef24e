"""The local OpenAI-compatible HTTP API over the pool (Starlette + uvicorn + sse-starlette).

Endpoints (see docs/API.md):

- ``GET /v1/models``, ``GET /v1/models/{id}``
- ``POST /v1/chat/completions``, ``POST /v1/completions`` (``"stream": true`` answers with SSE and
  ends with ``data: [DONE]``), routed to a model by the ``model`` field
- ``GET /timeshare/v1/status``: the GPU holder, every model's state, switch statistics
- ``POST /timeshare/v1/models/{id}/pin|unpin|sleep|wake|start``, ``POST /timeshare/v1/reload``
  (re-read the config file and apply it)
- ``GET /health`` (no key needed): the server is up
- the Anthropic Messages API (``anthropic``): ``POST /v1/messages``, ``/v1/messages/count_tokens``
- the Ollama API (``ollama``, ``ollama_models``, ``ollama_pull``): ``GET /``, ``/api/version``,
  ``/api/tags``, ``/api/ps``, ``POST /api/chat``, ``/api/generate``, ``/api/show``, ``/api/pull``,
  ``/api/embed``, ``DELETE /api/delete``; each dialect answers errors in its own shape

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. The server binds to
loopback by default; with ``api.key`` set every request needs ``Authorization: Bearer <key>``, and
a non-loopback bind is refused unless a key is set.

Blocking pool calls run on worker threads (anyio), never on the event loop. A client that goes away
cancels its generation: the SSE response notices it (sse-starlette listens for the disconnect), and
the non-streaming path watches the ASGI ``receive`` channel while it waits.
"""
