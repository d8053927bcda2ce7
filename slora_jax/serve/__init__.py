"""The OpenAI-compatible server over one `LLM`.

protocol.py   request parsing and validation
errors.py     the error shape (OpenAI's), with no server path in a message
responses.py  the pieces of a response: a choice's text and logprobs, usage
schema.py     the request bodies as pydantic models, for /openapi.json (clients, fuzzers)
chat.py       chat messages -> prompt token ids (the model's chat template)
async_engine  the engine thread, and the queue between it and the HTTP handlers
app.py        build_app: the FastAPI routes, middleware, metrics, graceful drain
streaming.py  server-sent events; waiting on work while watching for a client disconnect
cli.py        `slora-jax serve` (flags from EngineConfig), ServerThread
"""
