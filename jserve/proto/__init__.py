"""Generated gRPC modules for ``protos/jserve/v1/generate.proto`` (package ``jserve.v1``).

``generate_pb2`` holds the messages, ``generate_pb2_grpc`` the ``Generation`` stub and
servicer. Checked in; regenerate with ``python scripts/gen_protos.py`` (a test fails when they
are stale).
"""
