"""Asynchronous rollouts (docs/async.md): a producer thread reads the Trainer's data loader ahead of it and runs stage
one, `sample(rows)`, holding the engine's lock (no weight reload lands inside a round); the Trainer's loop receives the
same batches in the same order and runs stage two, `finish(samples)`, under the current weights. The consumer syncs
before waiting whenever the staleness gate needs it, so the producer never waits for a sync the consumer does not make.
"""

import queue
import threading
import time


class RoundRows(list):
    """The rows of a data-loader batch that opens a generation round, with the round's `Samples` and timings:
    `sample_s` (the producer's sampling), `backpressure_s` (its wait for weights or room), `enqueued_at`."""

    samples = None
    sample_s = backpressure_s = enqueued_at = wait_s = 0.0


_END = object()  # the producer's last item


class AsyncRollouts:
    """The producer of one epoch's iterator (see the module docstring); iterate it in the Trainer's place."""

    def __init__(self, trainer, source):
        args = trainer.args
        self.trainer, self.source, self.engine = trainer, source, trainer.vllm_engine
        self.window = args.steps_per_generation * args.num_iterations  # micro-steps one round serves
        self.accumulation = args.gradient_accumulation_steps
        self.base_step, self.base_micro = trainer.state.global_step, trainer._step
        self.opens_first = trainer._buffer is None  # no buffered round (start, or a resume without one)
        per_round = args.generation_batch_size // trainer.accelerator.num_processes
        self.room = threading.Semaphore(max(1, args.queue_maxsize // max(per_round, 1)))
        self.items, self.weights, self.stop = queue.Queue(), threading.Condition(), threading.Event()
        self.delivered, self.queued_rounds, self.heartbeat = 0, 0, time.monotonic()
        self.thread = threading.Thread(target=self._produce, name="trl_unified-rollout-producer", daemon=True)
        self.thread.start()

    def opens_round(self, index: int) -> bool:
        return (self.base_micro + index) % self.window == 0 or (index == 0 and self.opens_first)

    def consumption_step(self, index: int) -> int:
        """The optimiser step whose weights train on batch `index` (the Trainer takes `accumulation` per step)."""
        return self.base_step + index // self.accumulation

    def in_producer(self) -> bool:
        return threading.current_thread() is self.thread

    # ------------------------------------------------------------------ the producer thread
    def _produce(self) -> None:
        try:
            for index, rows in enumerate(self.source):
                self.heartbeat = time.monotonic()
                if not self.opens_round(index):
                    self.items.put(rows)
                    continue
                item, start = RoundRows(rows), time.perf_counter()
                while not self.room.acquire(timeout=0.1):
                    if self.stop.is_set():
                        return
                version = self.consumption_step(index) - self.trainer.args.max_staleness  # the weights it needs
                with self.weights:
                    while not self.stop.is_set() and (self.engine.version is None or self.engine.version < version):
                        if self.engine.sync_error is not None:  # the weights it waits for will not come
                            raise self.engine.sync_error
                        self.weights.wait(timeout=0.1)
                if self.stop.is_set():
                    return
                item.backpressure_s, start = time.perf_counter() - start, time.perf_counter()
                self.heartbeat = time.monotonic()
                with self.engine.lock:
                    item.samples = self.trainer.sample(rows)
                item.sample_s, item.enqueued_at = time.perf_counter() - start, time.monotonic()
                self.queued_rounds += 1
                self.items.put(item)
            self.items.put(_END)
        except BaseException as error:  # noqa: BLE001 (raised in the Trainer's loop)
            self.items.put(error)

    # ------------------------------------------------------------------ the consumer (the Trainer's loop)
    def __iter__(self):
        return self

    def __next__(self):
        index = self.delivered
        if self.opens_round(index):  # the weights this round's gate needs, synced on every process alike
            self.trainer.sync_for_round(self.consumption_step(index))
            with self.weights:
                self.weights.notify_all()
        start = time.perf_counter()
        while True:
            try:
                item = self.items.get(timeout=0.5)
                break
            except queue.Empty:
                stale = time.monotonic() - self.heartbeat
                if stale > self.trainer.args.heartbeat_stale_after_s:
                    raise TimeoutError(
                        f"The rollout producer made no progress for {stale:.0f}s (heartbeat_stale_after_s="
                        f"{self.trainer.args.heartbeat_stale_after_s}) while training waited for its next round."
                    ) from None
        if isinstance(item, BaseException):
            raise item
        if item is _END:
            raise StopIteration
        self.delivered += 1
        if isinstance(item, RoundRows):
            self.room.release()
            self.queued_rounds -= 1
            item.wait_s = time.perf_counter() - start
        return item

    def close(self) -> None:
        """Stop the producer and wait for it (a request in flight ends within `request_timeout`)."""
        self.stop.set()
        with self.weights:
            self.weights.notify_all()
        self.thread.join(timeout=self.trainer.args.request_timeout)
        if self.engine.syncing is not None:  # a weight sync still running in the background
            self.engine.syncing.join()
