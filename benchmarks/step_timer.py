"""`StepTimer`: the callback every benchmark uses to time optimiser steps (benchmarks/ is on sys.path when a
benchmark script runs)."""

import time

from transformers import TrainerCallback


class StepTimer(TrainerCallback):
    """Wall-clock seconds of each training step, in `times` (report medians without the first, warm-up step)."""

    def __init__(self):
        self.times = []

    def on_step_begin(self, *args, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.times.append(time.perf_counter() - self.start)
