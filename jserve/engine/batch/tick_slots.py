"""The packed buffers of an engine step: the built step's own (one device, tp, kvp) or, for
a stream-pipeline tick (spp > 1), every slot's packed step at the tick's shape, the smallest
bucket covering every batch in the pipeline (``sharding.pipeline``). Each batch in flight
keeps the ``BuiltStep`` it was launched with; a tick re-pads it (``BuiltStep.resized``)
rather than rebuilding it from request state, and the batch's record takes the re-padded
step, so the exiting batch's sample rows name rows of the tick's samples.

A lone batch (``InFlight.lone``: the pipeline empty and nothing else to schedule) is not a
tick but a pass through every stage in one executable: its own buffers at its own shape,
like the plain step's, and it leaves the device in the step that launched it."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jserve.engine.batch.builder import BuiltStep, StepBuilder
from jserve.sampling.sampler import SamplerRow
from sharding.distributed import Launch


class TickSlots:
    """``runner``: its ``programs.compiled(shape)`` gives the shape's ``PackedLayout``."""

    def __init__(self, runner, builder: StepBuilder, neutral_row: SamplerRow, spp: int):
        self.runner, self.builder, self.neutral_row, self.spp = runner, builder, neutral_row, spp
        self._empty: dict[tuple[int, int], BuiltStep] = {}
        self._empty_packed: dict[tuple[int, int], tuple] = {}
        # The previous tick's packed slots, (step, shape) -> buffers: a batch is packed once
        # per tick shape it meets, not once per tick (the step is held, so ids stay unique).
        self._packed: dict[tuple[int, tuple[int, int]], tuple] = {}

    def empty(self, shape: tuple[int, int]) -> BuiltStep:
        if shape not in self._empty:
            self._empty[shape] = self.builder.empty(shape, self.neutral_row)
        return self._empty[shape]

    def shape(self, steps: Sequence[BuiltStep | None]) -> tuple[int, int]:
        """The tick's shape: the smallest bucket at least every live slot's built shape."""
        return self.builder.buckets.covering((s.original or s).shape for s in steps
                                             if s is not None)

    def buffers(self, new: BuiltStep | None, in_flight: Sequence, lone: bool = False
                ) -> tuple[tuple[int, int], tuple, Launch]:
        """The step's shape, ``ModelRunner.execute_packed``'s buffers and bitmask
        (``PackedLayout.pack``) and its ``Launch``. With spp == 1 or ``lone`` (spp > 1: a
        pass): ``new``'s shape and its own. A tick: ``new`` is the batch entering stage 0
        (None: an empty slot), ``in_flight`` the records of the batches entering stages 1,
        2, ... (None or missing: empty), each with a ``built`` step, which becomes the
        re-padded one; returns the tick's shape, its [spp, size] int32 and float32 buffers,
        the bitmask of the batch leaving the last stage, and ``Launch.NO_EXIT`` when no
        batch leaves it."""
        if self.spp == 1 and new.packed is not None:  # the builder packed it
            return new.shape, new.packed, Launch.STEP
        if self.spp == 1 or lone:
            launch = Launch.PASS if lone else Launch.STEP
            packed = self.runner.programs.compiled(new.shape, launch)[1].pack(new.arrays,
                                                                              new.masked)
            return new.shape, packed, launch
        records = [None] + list(in_flight)
        records += [None] * (self.spp - len(records))
        steps = [new] + [r.built if r is not None else None for r in records[1:]]
        shape = self.shape(steps)
        layout = self.runner.programs.compiled(shape)[1]
        packed, rows = {}, []
        for record, step in zip(records, steps):
            if step is None:
                if shape not in self._empty_packed:
                    self._empty_packed[shape] = layout.pack(self.empty(shape).arrays)
                rows.append(self._empty_packed[shape])
                continue
            key = (id(step.original or step), shape)  # the held step keeps the id unique
            held = self._packed.get(key) or packed.get(key)
            if held is None:
                resized = step.resized(self.empty(shape))
                held = (resized, layout.pack(resized.arrays, resized.masked))
            packed[key] = held
            rows.append(held[1])
            if record is not None:
                record.built = held[0]
        self._packed = packed
        return shape, (np.stack([i for i, _, _ in rows]), np.stack([f for _, f, _ in rows]),
                       rows[-1][2]), Launch.STEP if steps[-1] is not None else Launch.NO_EXIT
