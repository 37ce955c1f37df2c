"""The benchmark harness: workloads, the benchmarks, profilers, device checks and paper
reproductions behind ``scripts/`` (each script there is a short entry point: flags, then a
call into this package). Not part of the installed ``jserve``: scripts run as
``python scripts/foo.py``, which puts ``scripts/`` first on ``sys.path``, so this is
``import harness``; the tests find it through pytest's ``pythonpath``. ``harness`` imports
``jserve``, never the reverse (tests/test_layering.py)."""
