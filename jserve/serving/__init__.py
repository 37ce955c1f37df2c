"""The serving layer: ``jserve serve``, gRPC and an OpenAI-compatible HTTP API from one engine.

``protocol`` converts between the gRPC wire messages and the offline API's types,
``engine_loop`` runs the (not thread-safe) engine in a thread of its own and streams outputs
back to asyncio, ``gateway`` is the path of one request shared by both front ends (admission,
validation, ids, the in-flight set, outcome accounting), ``metrics`` exports Prometheus
metrics, ``server`` is the ``grpc.aio`` service and process lifecycle (health, reflection,
TLS, bearer auth, SIGTERM drain), ``openai_api`` the HTTP front end (Starlette on uvicorn).
Guide: ``docs/server.md``.
"""
