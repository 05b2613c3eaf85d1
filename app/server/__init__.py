"""`llamaterm serve`: one engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn). Every client's requests
go to the one engine, which batches them. A module a concept:

    requests     a request's body parsed and checked, before any tokenizing
    grammars     the grammar a reply must match, from the request's fields
    supervisor   the engine kept running: restarted when it dies, the server stopped when it dies too often
    streaming    the engine's events to the client: the pump, server-sent events, whole replies
    handlers     the routes: who may ask, the body read in time, the request submitted
    metrics      the engine's stats in Prometheus' text format
    errors       OpenAI-style error objects
    http_server  uvicorn with deadlines on headers and a bounded drain
"""
