"""Asynchronous rollouts (online/async_rollouts.py) without vLLM: a stand-in server engine samples with a copy of the
weights taken at each sync (so a round really is sampled by the weights it is stamped with), optionally slowly.
max_staleness=0 equals synchronous training bit for bit; staleness stays within its bound and 1 is observed when the
trainer is slow; every prompt is consumed once, across a resume too; a producer error reaches train() at once; no
thread outlives train(). The real server is tests/vllm."""

import threading
import time

import pytest
import torch
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
