"""Time model of the LoongServe-like baseline: ``n`` identical model instances (the mesh's
TP groups) with elastic sequence parallelism (ESP).

Deliberately simple:
- a prefill chunk whose request has ESP degree d runs on d instances in 1 / (d x e) of its
  single-instance time (e = ``efficiency`` for d > 1, an assumed scaling efficiency, 0.9 by
  default; attention and matmuls both split over the instances). Chunks of different degrees
  in one iteration run one after another; chunks of one degree are batched together;
- the decodes are spread evenly over the instances no prefill occupies and run beside the
  prefill (iteration = the longer of the two); when every instance prefills, each also runs
  its 1 / n share of the decodes after its prefill work (iteration = the sum). One instance's
  share is timed as every m-th decode of the batch (m instances sharing).
KV capacity is the instances' sum; KV migration between instances is free.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

from jserve.scheduler.plan import BatchPlan
from jserve.scheduler.predictor import RuntimePredictor


class EspTimeModel:
    def __init__(self, instance: RuntimePredictor, num_instances: int,
                 degree_of: Callable[[str], int], efficiency: float = 0.9):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        self.instance = instance
        self.num_instances = num_instances
        self.degree_of = degree_of
        self.efficiency = efficiency

    def predict(self, plan: BatchPlan) -> float:
        if plan.is_empty:
            return 0.0
        by_degree: dict[int, list] = defaultdict(list)
        for c in plan.prefills:
            by_degree[min(self.degree_of(c.request_id), self.num_instances)].append(c)
        prefill = sum(self.instance.predict(BatchPlan((), tuple(chunks)))
                      / (d * (self.efficiency if d > 1 else 1.0))
                      for d, chunks in by_degree.items())
        free = self.num_instances - max(by_degree, default=0)
        share = plan.decodes[::free or self.num_instances]
        decode = self.instance.predict(BatchPlan(share, ())) if share else 0.0
        return max(prefill, decode) if free else prefill + decode
