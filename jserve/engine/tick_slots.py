"""Host side of a stream-pipeline tick (spp > 1): the tick's shape, the smallest bucket
covering every batch in the pipeline, and every slot's packed step at that shape
(``sharding.pipeline``). Each batch in flight keeps the ``BuiltStep`` it was launched with;
a tick re-pads it (``BuiltStep.resized``) rather than rebuilding it from request state."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jserve.engine.step_builder import BuiltStep, StepBuilder
from jserve.sampling.sampler import SamplerRow


class TickSlots:
    """``runner``: its ``compiled(shape)`` gives the shape's ``PackedLayout``."""

    def __init__(self, runner, builder: StepBuilder, neutral_row: SamplerRow, spp: int):
        self.runner, self.builder, self.neutral_row, self.spp = runner, builder, neutral_row, spp
        self._empty: dict[tuple[int, int], BuiltStep] = {}
        self._empty_packed: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        # The previous tick's packed slots, (step, shape) -> buffers: a batch is packed once
        # per tick shape it meets, not once per tick (the step is held, so ids stay unique).
        self._packed: dict[tuple[int, tuple[int, int]], tuple] = {}

    def empty(self, shape: tuple[int, int]) -> BuiltStep:
        if shape not in self._empty:
            self._empty[shape] = self.builder.empty(shape, self.neutral_row)
        return self._empty[shape]

    def shape(self, steps: Sequence[BuiltStep | None]) -> tuple[int, int]:
        """The tick's shape: the smallest bucket at least every live slot's own shape."""
        return self.builder.buckets.covering(s.shape for s in steps if s is not None)

    def buffers(self, steps: Sequence[BuiltStep | None]
                ) -> tuple[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """``steps``: slot ``s`` is the batch stage ``s`` runs this tick (slot 0 the new one,
        None or a missing slot: empty). Returns the tick's shape and its [spp, size] int32
        and float32 buffers."""
        shape = self.shape(steps)
        layout = self.runner.compiled(shape)[1]
        packed = {}
        rows = []
        for step in list(steps) + [None] * (self.spp - len(steps)):
            if step is None:
                if shape not in self._empty_packed:
                    self._empty_packed[shape] = layout.pack(self.empty(shape).arrays)
                rows.append(self._empty_packed[shape])
                continue
            key = (id(step), shape)
            held = self._packed.get(key) or packed.get(key)
            bufs = held[1] if held else layout.pack(step.resized(self.empty(shape)).arrays)
            packed[key] = (step, bufs)
            rows.append(bufs)
        self._packed = packed
        return shape, (np.stack([i for i, _ in rows]), np.stack([f for _, f in rows]))
