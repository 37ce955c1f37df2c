"""Routing across replicas: what a replica reports (``load``), how a replica builds its report
from its scheduler (``replica``), the policies that pick a replica from the reports
(``policies``), and where a request is prefilled and decoded when prefill-only engines exist
(``disagg``). Pure Python, no JAX, like ``jserve.scheduler``: the live routers (Ray Serve,
``scripts/bench_routing.py``) and the simulator's cluster mode (``jserve.sim.cluster``) run the
same decisions."""
from jserve.routing.disagg import MODES, Placement, TransferCost, place
from jserve.routing.load import PrefillTable, QueuedPrefill, ReplicaLoad, predicted_ttft
from jserve.routing.policies import ROUTERS, ReplicaView, Router, RouteRequest, choose

__all__ = ["MODES", "Placement", "PrefillTable", "QueuedPrefill", "ROUTERS", "ReplicaLoad",
           "ReplicaView", "RouteRequest", "Router", "TransferCost", "choose", "place",
           "predicted_ttft"]
