"""The OpenAI-compatible server over one `LLM`.

schema.py     the request bodies as pydantic models: their shape, types and static bounds, validated
              by the routes and published at /openapi.json (clients, fuzzers)
protocol.py   the JSON body's own checks, and what the models cannot check (vocabulary, context
              length, the pool), on the validated model
errors.py     the error shape (OpenAI's), with no server path in a message
responses.py  the pieces of a response: a choice's text and logprobs, usage
chat.py       chat messages -> prompt token ids (the model's chat template)
async_engine  the engine thread, and the queue between it and the HTTP handlers
app.py        build_app: the FastAPI routes, middleware, metrics, graceful drain
streaming.py  server-sent events; waiting on work while watching for a client disconnect
cli.py        `slora-jax serve` (flags from EngineConfig), ServerThread
"""
