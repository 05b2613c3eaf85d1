"""`llamaterm serve`: one engine behind an OpenAI-compatible HTTP API (Starlette on uvicorn), a module a concept:
requests (the body checked), grammars, supervisor (the engine kept running), streaming (events to the client),
handlers (the routes), metrics, errors, http_server (uvicorn with deadlines and a bounded drain).
"""
