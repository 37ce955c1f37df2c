"""The gRPC serving layer: ``jserve serve``.

``protocol`` converts between the wire messages and the offline API's types, ``engine_loop``
runs the (not thread-safe) engine in a thread of its own and streams outputs back to asyncio,
``metrics`` exports Prometheus metrics, ``server`` is the ``grpc.aio`` service and process
lifecycle (health, reflection, TLS, bearer auth, SIGTERM drain). Guide: ``docs/server.md``.
"""
