"""Asynchronous rollouts (online/async_rollouts.py) without vLLM: a stand-in server engine samples with a copy of the
weights taken at each sync (so a round really is sampled by the weights it is stamped with), optionally slowly.
max_staleness=0 equals synchronous training bit for bit; staleness stays within its bound and 1 is observed when the
trainer is slow; every prompt is consumed once, across a resume too; a producer error reaches train() at once; no
thread outlives train(). The real server is tests/vllm."""

import threading
import time
import types

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from tests.helpers import grpo_args, prompt_dataset, rloo_args, varied_reward
from trl_unified import GRPOTrainer, RLOOTrainer
from trl_unified.testing import build_causal_lm


def trainer_for(kind, tokenizer, tmp_path, engines, sleep=0.0, **overrides):
    """A GRPO/RLOO trainer with asynchronous rollouts on the stand-in server; `sleep`: seconds added to each
    optimiser step (a slow trainer)."""
    make_args = grpo_args if kind is GRPOTrainer else rloo_args
    settings = dict(use_vllm=True, vllm_mode="server", async_rollouts=True, max_steps=4, per_device_train_batch_size=4,
                    num_generations=2)  # fmt: skip
    args = make_args(tmp_path, **{**settings, **overrides})
    trainer = kind(build_causal_lm(tokenizer), varied_reward, args=args, train_dataset=prompt_dataset(32),
                   processing_class=tokenizer)  # fmt: skip
    trainer.consumed = []  # (global step, policy version, prompts) of each round trained on
    finish = trainer.finish

    def recording_finish(samples):
        trainer.consumed.append(
            (trainer.state.global_step, samples.policy_version, [r["prompt"] for r in samples.rows])
        )
        return finish(samples)

    trainer.finish = recording_finish
    if sleep:

        class Slow(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                time.sleep(sleep)

        trainer.add_callback(Slow())
    return trainer


def producer_threads():
    return [t for t in threading.enumerate() if t.name == "trl_unified-rollout-producer"]


def test_max_staleness_0_is_synchronous_training_bit_for_bit(tokenizer, tmp_path, engines):
    logs, params = {}, {}
    for name, overrides in (("sync", dict(async_rollouts=False)), ("async", dict(max_staleness=0))):
        trainer = trainer_for(GRPOTrainer, tokenizer, tmp_path / name, engines, **overrides)
        trainer.train()
        assert len(trainer.consumed) == 4 and ("sample/staleness_mean" in trainer.state.log_history[0]) == (
            name == "async"
        )  # the async run went through the producer
        async_only = ("perf/", "sample/", "rollout/", "sampling/importance_sampling_ratio/staleness_")
        logs[name] = [{k: v for k, v in log.items() if "time" not in k and not k.startswith(async_only)}
                      for log in trainer.state.log_history]  # fmt: skip
        params[name] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert all(version == step for step, version, _ in trainer.consumed), trainer.consumed
    assert logs["async"][:-1] == logs["sync"][:-1]  # the last entry is the run summary (runtime)
    for name, value in params["sync"].items():
        assert torch.equal(value, params["async"][name]), name
    assert not producer_threads()


@pytest.mark.parametrize("kind", [GRPOTrainer, RLOOTrainer])
def test_staleness_stays_within_its_bound_and_the_overlap_happens(kind, tokenizer, tmp_path, engines):
    trainer = trainer_for(kind, tokenizer, tmp_path, engines, sleep=0.3, max_staleness=1, max_steps=6)
    trainer.train()
    staleness = [step - version for step, version, _ in trainer.consumed]
    assert all(0 <= s <= 1 for s in staleness), staleness
    assert 1 in staleness, staleness  # a round sampled while the previous one trained
    logged = [log for log in trainer.state.log_history if "sample/staleness_max" in log]
    assert max(log["sample/staleness_max"] for log in logged) == 1
    assert all(log["sample/dropped_stale_total"] == 0 for log in logged)
    assert {"perf/rollout_wait_s", "perf/weight_sync_s", "sample/rollout_queue_size"} <= set().union(*logged)
    assert not producer_threads()


def test_each_prompt_is_consumed_once_across_a_resume(tokenizer, tmp_path, engines):
    full = trainer_for(GRPOTrainer, tokenizer, tmp_path / "full", engines, max_staleness=2, max_steps=6)
    full.train()
    first = trainer_for(GRPOTrainer, tokenizer, tmp_path / "part", engines, max_staleness=2, max_steps=6,
                        save_strategy="steps", save_steps=3)  # fmt: skip
    first.callback_handler.add_callback(StopAt(3))
    first.train()
    resumed = trainer_for(GRPOTrainer, tokenizer, tmp_path / "part", engines, max_staleness=2, max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "grpo" / "checkpoint-3"))
    rounds = [prompts for _, _, prompts in first.consumed[:3] + resumed.consumed]
    assert rounds == [prompts for _, _, prompts in full.consumed]  # the same prompts, each round once, in order
    assert len({tuple(p) for p in rounds}) == len(rounds)
    assert not producer_threads()


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_a_producer_error_reaches_train_at_once(tokenizer, tmp_path, engines):
    engines.options = dict(fail_at=3)
    trainer = trainer_for(GRPOTrainer, tokenizer, tmp_path, engines, max_steps=8)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="the stand-in server went away"):
        trainer.train()
    assert time.monotonic() - start < 30 and not producer_threads()


def test_async_rollouts_need_a_server(tmp_path):
    with pytest.raises(ValueError, match="async_rollouts=True needs .* vllm_mode='server'"):
        grpo_args(tmp_path, async_rollouts=True)


# ------------------------------------------------------------------ the producer's thread contract
def test_two_threads_never_hand_one_environment_instance_to_two_rounds(monkeypatch):
    """The producer assigns instances while the trainer releases others: 10,000 rounds of 3 rows over two threads,
    switching threads as often as the interpreter allows; no instance is ever held by two rounds at once."""
    import sys

    from trl_unified.online.agents import Environments

    class Plain:
        def reset(self, **kwargs):
            return None

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    environments, holders, clashes = Environments(Plain, []), {}, []

    def rounds(tag):
        for i in range(5000):
            instances = environments.assign([{}] * 3)
            for instance in instances:
                if holders.setdefault(id(instance), (tag, i)) != (tag, i):
                    clashes.append((tag, i))
            for instance in instances:
                holders.pop(id(instance), None)
            environments.release(instances)

    try:
        threads = [threading.Thread(target=rounds, args=(tag,)) for tag in ("producer", "trainer")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)
    assert clashes == []
    assert sorted(map(id, environments.free[None])) == sorted(map(id, environments.pool[None]))  # all returned
    # On CPython's GIL the unguarded list updates happen to be atomic too; the exclusion itself, checked directly:
    # while one thread is inside the pool's critical section, another's assign and release wait for it.
    with environments._lock:
        waiting = [
            threading.Thread(target=environments.assign, args=([{}],)),
            threading.Thread(target=environments.release, args=(list(environments.pool[None][:1]),)),
        ]
        for thread in waiting:
            thread.start()
            thread.join(timeout=0.2)
            assert thread.is_alive()
    for thread in waiting:
        thread.join(timeout=5)
        assert not thread.is_alive()


class SeenPrompt:
    """An environment that remembers the prompt its `reset` saw (a reward reading it must read its own row's)."""

    def reset(self, prompt, **kwargs):
        self.seen = prompt

    def get_reward(self) -> float:
        return 0.0


def test_every_reward_reads_the_environment_of_its_own_row(monkeypatch, tmp_path):
    """Asynchronous rollouts with environments, max_staleness=2, 30 steps: the producer resets the next rounds'
    instances while the trainer scores and trains on earlier ones; every row's environment saw that row's prompt."""
    from tests.helpers import SnapshotEngine
    from trl_unified.generation.vllm_engine import VLLMEngine
    from trl_unified.testing import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    monkeypatch.setattr(VLLMEngine, "from_args", staticmethod(lambda args, m, a: SnapshotEngine(args, tokenizer)))
    mismatches, scored = [], []

    def own_row(prompts, environments, **kwargs):
        scored.append(len(prompts))
        mismatches.extend(p for p, e in zip(prompts, environments) if e.seen != p)
        return [float(e.seen == p) for p, e in zip(prompts, environments)]

    prompts = [[{"role": "user", "content": f"what is {i} plus {i + 1}"}] for i in range(40)]
    args = grpo_args(tmp_path, use_vllm=True, vllm_mode="server", async_rollouts=True, max_staleness=2, max_steps=30,
                     per_device_train_batch_size=4, num_generations=2, max_completion_length=3)  # fmt: skip
    trainer = GRPOTrainer(
        build_causal_lm(tokenizer), [own_row], args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}), environment_factory=SeenPrompt,
    )  # fmt: skip
    trainer.train()
    assert len(scored) == 30 and mismatches == []
    assert all(e.seen in prompts for e in trainer.environments)  # the round trained last
    assert not producer_threads()


def stand_in_trainer(server, tokenizer, tmp_path, **overrides):
    """GRPO with asynchronous rollouts against the HTTP stand-in server (tests/jobs/vllm_server_stand_in.py)."""
    settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=20,
                    async_rollouts=True, max_steps=3, per_device_train_batch_size=4, num_generations=2)  # fmt: skip
    args = grpo_args(tmp_path, **{**settings, **overrides})
    return GRPOTrainer(build_causal_lm(tokenizer), varied_reward, args=args, train_dataset=prompt_dataset(32),
                       processing_class=tokenizer)  # fmt: skip


@pytest.fixture
def server():
    from tests.jobs.vllm_server_stand_in import VLLMServerStandIn

    stand_in = VLLMServerStandIn()
    yield stand_in
    stand_in.down()


def test_a_slow_round_of_a_working_server_is_not_taken_for_a_hang(server, tokenizer, tmp_path):
    """A round takes 3 s, heartbeat_stale_after_s=1: the server answers /health meanwhile, so training waits."""
    server.stall_for = 3.0
    trainer = stand_in_trainer(server, tokenizer, tmp_path, heartbeat_stale_after_s=1.0)
    trainer.train()
    assert trainer.state.global_step == 3 and not producer_threads()
    waits = [log["perf/rollout_wait_s"] for log in trainer.state.log_history if "perf/rollout_wait_s" in log]
    assert max(waits) > 1.0, waits


def test_a_hung_server_trips_the_heartbeat_with_its_url_and_no_thread_survives(server, tokenizer, tmp_path):
    """The server hangs after its first completion (no answer, /health included): train() raises TimeoutError naming
    the server within seconds, and the producer, blocked in its request, is stopped (the request aborted)."""
    server.hang(after=1)
    trainer = stand_in_trainer(server, tokenizer, tmp_path, heartbeat_stale_after_s=1.0, max_steps=6)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"engine at {server.url} does not answer"):
        trainer.train()
    assert time.monotonic() - start < 30
    assert not producer_threads()


def test_the_producer_ends_with_stop_iteration_every_time():
    """After the end of the data, `next()` raises StopIteration again at once (an iterator's contract)."""
    from trl_unified.generation.vllm_engine import VLLMEngine
    from trl_unified.online.async_rollouts import AsyncRollouts, EpochStart, ProducerLimits, RoundSchedule

    engine = VLLMEngine(types.SimpleNamespace())
    engine.synced = (0, 0)
    limits = ProducerLimits(
        max_staleness=1, queued_rounds=2, heartbeat_stale_after_s=60, stop_timeout_s=5, weight_sync_timeout=5
    )
    producer = AsyncRollouts(
        iter([["a"], ["b"], ["c"]]),
        sample=lambda rows: list(rows),
        engine=engine,
        schedule=RoundSchedule(window=2, accumulation=1),
        start=EpochStart(step=0, micro_step=0, has_round=False),
        limits=limits,
        prepare_round=lambda step: setattr(engine, "synced", (0, step)),  # the trainer's sync for the round's gate
    )
    batches = list(producer)
    assert [b.opens_round for b in batches] == [True, False, True] and [b.samples for b in batches][::2] == [
        ["a"], ["c"]
    ]  # fmt: skip
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(StopIteration):
            next(producer)
        assert time.monotonic() - start < 0.1
    producer.close()
    assert not producer.thread.is_alive()
