"""Asynchronous rollouts on a real vLLM CPU server (the `vllm` group): AsyncGRPOTrainer and the opt-in async GRPO /
RLOO learn the toy task, the server's greedy completions after training equal transformers' `generate` on the trained
weights, and a run rides through the server being killed and restarted mid-run (its last weights loaded back into the
restarted server before it generates again)."""

import os
import subprocess
import sys
import threading
import time
from statistics import mean

import pytest
from transformers import TrainerCallback

from tests.helpers import count_a, grpo_args, prompt_dataset, rloo_args, tiny_run_args, varied_reward
from tests.vllm.test_vllm import HIDDEN, _free_port, assert_trained_and_equal, stop_group, vllm_server
from trl_unified import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOTrainer, RLOOTrainer
from trl_unified.testing import build_causal_lm, save_tiny_model


pytestmark = pytest.mark.vllm
LEARN = dict(
    max_steps=50,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=12,
    learning_rate=3e-3,
    beta=0.0,
    seed=0,
    logging_steps=1,
)


def server_settings(port):
    return dict(
        use_vllm=True, vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=240
    )


@pytest.mark.parametrize("kind", ["async_grpo", "grpo", "rloo"])
def test_async_rollouts_learn_on_a_real_server(kind, tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=0)
    with vllm_server(model, tokenizer, tmp_path) as (port, _):
        settings = {**LEARN, **server_settings(port), "max_staleness": 1}
        if kind == "async_grpo":
            args = tiny_run_args(AsyncGRPOConfig, tmp_path / "async", **settings)
            trainer = AsyncGRPOTrainer(model, count_a, args, prompt_dataset(64), tokenizer)
        else:
            make_args, cls = (grpo_args, GRPOTrainer) if kind == "grpo" else (rloo_args, RLOOTrainer)
            args = make_args(tmp_path, async_rollouts=True, **settings)
            trainer = cls(model, count_a, args=args, train_dataset=prompt_dataset(64), processing_class=tokenizer)
        before = {n: p.clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        assert_trained_and_equal(trainer, tokenizer, before)  # the server holds the trained weights exactly
    logs = trainer.state.log_history
    rewards = [log["reward"] for log in logs if "reward" in log]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.3, rewards
    staleness = [log["sample/staleness_max"] for log in logs if "sample/staleness_max" in log]
    assert max(staleness) <= 1 and len(staleness) == 50


class KillAndRestart(TrainerCallback):
    """At `step`: kill the server's process group, and start a new server on the same port from the original
    checkpoint (about 25 s on 2 cores until it answers /health)."""

    def __init__(self, server, command, env, log, step):
        self.server, self.command, self.env, self.log, self.step, self.restarted = server, command, env, log, step, []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            stop_group(self.server)
            self.restarted.append(
                subprocess.Popen(
                    self.command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )


def test_a_run_rides_through_the_server_being_killed_and_restarted(tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=1)
    path, port = save_tiny_model(model, tokenizer, str(tmp_path / "model")), _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--gpu-memory-utilization",
        "0.3",
    ]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    killer = KillAndRestart(server, command, env, log, step=3)
    try:
        args = tiny_run_args(
            AsyncGRPOConfig,
            tmp_path / "async",
            **{
                **server_settings(port),
                "max_steps": 6,
                "num_generations": 4,
                "max_completion_length": 8,
                "save_strategy": "steps",
                "save_steps": 2,
            },
        )
        # varied_reward: spread on random completions, so every step changes the weights the restarted server must
        # get (count_a left whole groups at reward 0 in some runs: zero advantages, nothing trained, a flaky check)
        trainer = AsyncGRPOTrainer(model, varied_reward, args, prompt_dataset(), tokenizer, callbacks=[killer])
        before = {n: p.clone() for n, p in trainer.model.named_parameters()}
        start = time.monotonic()
        trainer.train()
        assert trainer.state.global_step == 6 and killer.restarted, "the run did not finish through the restart"
        assert_trained_and_equal(trainer, tokenizer, before)  # the restarted server got the trained weights
        assert time.monotonic() - start < 600
        assert not [t for t in threading.enumerate() if t.name == "trl_unified-rollout-producer"]
    finally:
        for process in [server, *killer.restarted]:
            if process.poll() is None:
                stop_group(process)
        log.close()


def test_every_reward_reads_its_own_rows_environment_on_a_real_server(tmp_path):
    """Issue 51 on a real server: asynchronous rollouts with environments (max_staleness=2, 12 steps); the producer
    resets the next rounds' instances while the trainer scores earlier ones, and every row's environment saw that
    row's prompt; no producer thread outlives train()."""
    from datasets import Dataset

    from tests.online.test_async import SeenPrompt
    from trl_unified.testing import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=0)
    mismatches, scored = [], []

    def own_row(prompts, environments, **kwargs):
        scored.append(len(prompts))
        mismatches.extend(p for p, e in zip(prompts, environments) if e.seen != p)
        return [float(e.seen == p) for p, e in zip(prompts, environments)]

    prompts = [[{"role": "user", "content": f"what is {i} plus {i + 1}"}] for i in range(40)]
    with vllm_server(model, tokenizer, tmp_path) as (port, _):
        args = grpo_args(
            tmp_path,
            **server_settings(port),
            async_rollouts=True,
            max_staleness=2,
            max_steps=12,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=4,
        )
        trainer = GRPOTrainer(
            model,
            [own_row],
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            environment_factory=SeenPrompt,
        )
        trainer.train()
    assert len(scored) == 12 and mismatches == []
    assert not [t for t in threading.enumerate() if t.name == "trl_unified-rollout-producer"]
