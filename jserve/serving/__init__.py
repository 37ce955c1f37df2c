"""The serving layer: ``jserve serve``, gRPC and an OpenAI-compatible HTTP API from one engine.

``engine_api`` is all the serving layer sees of the engine (``EngineClient``), implemented by
``live_engine`` (``LLMEngine``) and ``fake_engine`` (scripted tokens, no JAX) over
``engine_loop``, which runs the (not thread-safe) engine in a thread of its own and streams
outputs back to asyncio; ``protocol`` converts between the gRPC wire messages and the offline
API's types, ``gateway`` is the path of one request shared by both front ends (admission,
validation off the event loop, ids, the in-flight set, outcome accounting), ``limits`` what
one client may ask for (SLO floors, priority range and trust), ``metrics`` exports Prometheus
metrics, ``server`` is the ``grpc.aio`` service and process lifecycle (health, reflection,
TLS, bearer auth, SIGTERM drain). The HTTP front end mirrors the gRPC side:
``http_protocol`` reads OpenAI request bodies, ``http_responses`` writes responses and
server-sent events, ``http_server`` is the Starlette/uvicorn app with its bounded edge.
Guide: ``docs/server.md``.
"""
