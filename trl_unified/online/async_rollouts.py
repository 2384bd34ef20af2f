"""Asynchronous rollouts (docs/async.md): a producer thread reads the Trainer's data loader ahead of it and runs stage
one, `sample(rows)`, holding the engine's lock (no weight reload lands inside a round); the Trainer's loop receives the
same batches in the same order and runs stage two, `finish(samples)`, under the current weights.

The thread contract (docs/async.md, "The producer thread"):

- **What the producer gets**: the epoch's data-loader iterator, the sampling function (`OnlineTrainer.sample`), the
  generation engine (its lock, the version of the weights it holds, a failed background sync), the round schedule
  (`RoundSchedule` and where the epoch starts: which batch opens a round, which optimiser step trains on it) and its
  limits (`ProducerLimits`). Never the trainer.
- **What it touches in its thread**: the iterator, `sample` (which reads the trainer's configuration, takes
  environment instances under their pool's lock, and generates while this thread holds the engine's lock), the queue
  and its own counters (under `_counts`).
- **What the consumer does** (the Trainer's loop, `__next__`): before it waits for a round, `prepare_round(step)`
  (the trainer's weight sync for that round's staleness gate), then it wakes the producer. Each batch it returns
  carries the schedule's answer (`ScheduledRows.opens_round`) and, if it opens a round, the round's `Samples`.
- **Health**: `heartbeat` means alive and working. The producer refreshes it at every step of its loop: a batch read,
  a round sampled, each wait for queue room or weights. While a round is being sampled (a request in flight, no
  refresh possible from the blocked thread), the waiting consumer asks the engine whether it answers
  (`engine.responsive`): an engine that answers is working (the request itself is bounded by `request_timeout`), one
  that does not is stalled, and the wait ends in an error naming the engine.
- **Stopping**: `close()` sets the stop event, wakes the producer, aborts the engine requests of its thread, joins it
  within `ProducerLimits.stop_timeout_s` and logs what it was doing if it must give up (the engine then gets a fresh
  lock: a stuck thread never blocks training); a weight sync running in the background is joined within
  `weight_sync_timeout`. After the end of the data, `next()` raises `StopIteration` every time.

The consumer syncs before waiting whenever the staleness gate needs it, so the producer never waits for a sync the
consumer does not make.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundSchedule:
    """Which data-loader batches open a generation round: the one rule the synchronous buffer
    (`OnlineTrainer._prepare_inputs`) and the producer both read.

    Fields:
        window (`int`): micro-steps one round serves (`steps_per_generation * num_iterations`).
        accumulation (`int`): micro-steps per optimiser step (gradient accumulation).
    """

    window: int
    accumulation: int

    def opens_round(self, micro_step: int, has_round: bool) -> bool:
        """A batch opens a round at the start of each window, or when no round is buffered (the start of training,
        or a resume that saved none)."""
        return micro_step % self.window == 0 or not has_round


@dataclass(frozen=True)
class EpochStart:
    """Where training stands when an epoch's producer starts: the optimiser step, the micro-step counter, and whether
    a round is buffered (one saved in a checkpoint)."""

    step: int
    micro_step: int
    has_round: bool


@dataclass(frozen=True)
class ProducerLimits:
    """The producer's bounds (from `OnlineConfig`): `max_staleness` (optimiser steps between the weights that sample a
    round and the step that trains on it), `queued_rounds` (rounds sampled and waiting), `heartbeat_stale_after_s`,
    `stop_timeout_s` (how long `close()` waits for the thread) and `weight_sync_timeout` (for a background sync)."""

    max_staleness: int
    queued_rounds: int
    heartbeat_stale_after_s: float
    stop_timeout_s: float
    weight_sync_timeout: float


class ScheduledRows(list):
    """A data-loader batch as the producer delivers it: the rows, whether it opens a generation round
    (`opens_round`, the schedule's answer), and for a round its `Samples` and timings: `sample_s` (the producer's
    sampling), `backpressure_s` (its wait for weights or room), `enqueued_at`, `wait_s` (training's wait for it)."""

    def __init__(self, rows, opens_round: bool):
        super().__init__(rows)
        self.opens_round = opens_round
        self.samples = None
        self.sample_s = self.backpressure_s = self.enqueued_at = self.wait_s = 0.0


_END = object()  # the producer's last item


class AsyncRollouts:
    """The producer of one epoch's iterator (see the module docstring); iterate it in the Trainer's place.

    Args:
        source (`Iterator`): the epoch's data-loader iterator.
        sample (`Callable[[list], Samples]`): stage one of a rollout, run in the producer thread.
        engine (`VLLMEngine`): the generation engine (server mode).
        schedule (`RoundSchedule`), start (`EpochStart`), limits (`ProducerLimits`).
        prepare_round (`Callable[[int], None]`): called by the consumer before it waits for the round trained at
            optimiser step `step` (the trainer's weight sync).
    """

    def __init__(
        self,
        source: Iterator,
        sample: Callable,
        engine,
        schedule: RoundSchedule,
        start: EpochStart,
        limits: ProducerLimits,
        prepare_round: Callable[[int], None],
    ):
        self.source, self.sample, self.engine = source, sample, engine
        self.schedule, self.start, self.limits, self.prepare_round = schedule, start, limits, prepare_round
        self.room = threading.Semaphore(max(1, limits.queued_rounds))
        self.items, self.weights, self.stop = queue.Queue(), threading.Condition(), threading.Event()
        self.delivered, self.finished = 0, False  # the consumer's
        self._counts = threading.Lock()  # guards `queued_rounds`, `activity` (written by the producer, read by both)
        self.queued_rounds, self.activity = 0, ("starting", time.monotonic())
        self.heartbeat = time.monotonic()
        self.thread = threading.Thread(target=self._produce, name="trl_unified-rollout-producer", daemon=True)
        self.thread.start()

    def opens_round(self, index: int) -> bool:
        """Whether batch `index` of the epoch opens a round (`RoundSchedule.opens_round` from the epoch's start)."""
        return self.schedule.opens_round(self.start.micro_step + index, self.start.has_round or index > 0)

    def consumption_step(self, index: int) -> int:
        """The optimiser step whose weights train on batch `index` (the Trainer takes `accumulation` per step)."""
        return self.start.step + index // self.schedule.accumulation

    def in_producer(self) -> bool:
        return threading.current_thread() is self.thread

    # ------------------------------------------------------------------ the producer thread
    def _beat(self, activity: str) -> None:
        """Alive and working: refresh the heartbeat and say what the producer is doing (and since when)."""
        self.heartbeat = time.monotonic()
        with self._counts:
            if self.activity[0] != activity:
                self.activity = (activity, self.heartbeat)

    def _produce(self) -> None:
        try:
            for index, rows in enumerate(self.source):
                self._beat("reading the data")
                item = ScheduledRows(rows, self.opens_round(index))
                if item.opens_round and not self._sample_round(item, index):
                    return  # stopped
                self.items.put(item)
            self.items.put(_END)
        except BaseException as error:  # noqa: BLE001 (raised in the Trainer's loop)
            self.items.put(error)
        finally:
            self._beat("stopped")

    def _sample_round(self, item: ScheduledRows, index: int) -> bool:
        """Wait for room and for weights recent enough for the round's staleness gate, then sample it holding the
        engine's lock. False when stopped while waiting."""
        start = time.perf_counter()
        while not self.room.acquire(timeout=0.1):
            if self.stop.is_set():
                return False
            self._beat("waiting for room in the queue")
        if not self._wait_for_weights(self.consumption_step(index) - self.limits.max_staleness):
            return False
        item.backpressure_s, start = time.perf_counter() - start, time.perf_counter()
        self._beat(f"sampling the round of batch {index}")
        with self.engine.lock:
            item.samples = self.sample(item)
        item.sample_s, item.enqueued_at = time.perf_counter() - start, time.monotonic()
        with self._counts:
            self.queued_rounds += 1
        self._beat("queued a round")
        return True

    def _wait_for_weights(self, version: int) -> bool:
        """Wait until the engine holds weights of optimiser step `version` or later (the consumer syncs them); raise
        a failed background sync. False when stopped."""
        with self.weights:
            while not self.stop.is_set() and (self.engine.version is None or self.engine.version < version):
                if self.engine.sync_error is not None:  # the weights it waits for will not come
                    raise self.engine.sync_error
                self.weights.wait(timeout=0.1)
                self._beat(f"waiting for the weights of step {version}")
        return not self.stop.is_set()

    # ------------------------------------------------------------------ the consumer (the Trainer's loop)
    def __iter__(self):
        return self

    def __next__(self) -> ScheduledRows:
        if self.finished:
            raise StopIteration
        index = self.delivered
        if self.opens_round(index):  # the weights this round's gate needs, synced on every process alike
            self.prepare_round(self.consumption_step(index))
            with self.weights:
                self.weights.notify_all()
        start = time.perf_counter()
        item = self._wait_for_item()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is _END:
            self.finished = True
            raise StopIteration
        self.delivered += 1
        if item.opens_round:
            self.room.release()
            with self._counts:
                self.queued_rounds -= 1
            item.wait_s = time.perf_counter() - start
        return item

    def _wait_for_item(self):
        """The producer's next item; raises `TimeoutError` when the producer is hung (`_check_health`)."""
        while True:
            try:
                return self.items.get(timeout=0.5)
            except queue.Empty:
                self._check_health()

    def _check_health(self) -> None:
        """Raise when the heartbeat is older than `heartbeat_stale_after_s`, unless the producer is inside a round and
        the engine answers (a long request of a working server: the heartbeat is refreshed); or when the producer has
        waited that long for weights that no sync is bringing (training waits for it, it waits for training)."""
        limit, now = self.limits.heartbeat_stale_after_s, time.monotonic()
        with self._counts:
            activity, since = self.activity
        syncing = self.engine.syncing is not None and self.engine.syncing.is_alive()
        if activity.startswith("waiting for the weights") and now - since > limit and not syncing:
            raise TimeoutError(
                f"The rollout producer has been {activity} for {now - since:.0f}s (heartbeat_stale_after_s={limit}), "
                f"but the engine holds step {self.engine.version} and no weight sync is running."
            )
        stale = now - self.heartbeat
        if stale <= limit:
            return
        if activity.startswith("sampling") and self.engine.responsive(timeout=min(5.0, stale)):
            self.heartbeat = time.monotonic()
            return
        where = getattr(self.engine, "base_url", type(self.engine).__name__)
        raise TimeoutError(
            f"The rollout producer made no progress for {stale:.0f}s (heartbeat_stale_after_s="
            f"{self.limits.heartbeat_stale_after_s}) while training waited for its next round: it has been "
            f"{activity} for {time.monotonic() - since:.0f}s, and the engine at {where} does not answer."
        )

    def drain(self) -> list:
        """The items the producer queued that training did not take (after `close`)."""
        items = []
        while True:
            try:
                items.append(self.items.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        """Stop the producer (the module docstring, "Stopping"); safe to call more than once."""
        self.stop.set()
        with self.weights:
            self.weights.notify_all()
        self.engine.abort_requests(self.thread)
        self.thread.join(timeout=self.limits.stop_timeout_s)
        if self.thread.is_alive():
            with self._counts:
                activity, since = self.activity
            logger.warning(
                f"The rollout producer did not stop within {self.limits.stop_timeout_s}s: it has been {activity} for "
                f"{time.monotonic() - since:.0f}s. It is left to end on its own (a daemon thread); the engine gets "
                "a new lock so that training is not blocked by it."
            )
            self.engine.lock = type(self.engine.lock)()
        syncing = self.engine.syncing
        if syncing is not None:  # a weight sync still running in the background
            syncing.join(timeout=self.limits.weight_sync_timeout)
            if syncing.is_alive():
                logger.warning(
                    f"A background weight sync did not finish within weight_sync_timeout="
                    f"{self.limits.weight_sync_timeout}s; left running."
                )
