"""`StepTimer`: the callback every benchmark uses to time optimiser steps, and `peak_rss_kib`, the process's peak
memory (benchmarks/ is on sys.path when a benchmark script runs; nothing here imports trl_unified, so that TRL's side
of a comparison runs without it)."""

import resource
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


class PhaseTimer(TrainerCallback):
    """Where a step's time goes: `phases[name]` holds the seconds spent per step in the calls watched with
    `watch(name, obj, method)` (e.g. the reference model's forward, or a trainer's generation method) and, as
    "optimiser", between the pre- and post-optimiser-step events; what remains of a step is the policy's forward and
    backward (and the library's own work)."""

    def __init__(self):
        self.phases, self._current = {"optimiser": []}, {}

    def watch(self, name: str, obj, method: str = "forward") -> None:
        self.phases[name] = []
        forward = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - start

        setattr(obj, method, timed)

    def on_step_begin(self, *args, **kwargs):
        self._current = {}

    def on_pre_optimizer_step(self, *args, **kwargs):
        self._optimiser_start = time.perf_counter()

    def on_optimizer_step(self, *args, **kwargs):
        self._current["optimiser"] = time.perf_counter() - self._optimiser_start

    def on_step_end(self, *args, **kwargs):
        for name, values in self.phases.items():
            values.append(self._current.get(name, 0.0))


def peak_rss_kib() -> int:
    """This process's peak resident set size in KiB, from `VmHWM` (as `trl_unified.testing.peak_rss_kib`, which says
    why not `ru_maxrss`: a subprocess inherits its parent's high-water mark through vfork + exec)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak_rss() -> None:
    """Start `peak_rss_kib` over from the current resident size (Linux: "5" to /proc/self/clear_refs), to measure
    a phase's peak, e.g. training after the models were built."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
