"""vLLM for real (the `vllm` group, its own environment: .ci/vllm): after training, vLLM's greedy completions equal
transformers' `generate` on the trained policy token for token (colocate: full model, PEFT, 2 processes; server
mode end to end), the online trainers learn with `use_vllm=True`, and bad settings are named before training.

The tiny models here have 32-wide attention heads (vLLM's CPU attention has no kernel for narrower ones). Colocated
engines with the same settings are reused within the process, so the file starts few engines."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from statistics import mean

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from tests.distributed.test_multiprocess import ROOT, launch
from tests.helpers import PROMPTS, UNSET, count_a, grpo_args, prompt_dataset, rloo_args, tiny_run_args, varied_reward
from trl_unified import GRPOTrainer, OnlineDPOConfig, OnlineDPOTrainer, PPOConfig, PPOTrainer, RLOOTrainer
from trl_unified.generation import generate_batched
from trl_unified.testing import build_causal_lm, build_sequence_classifier, save_tiny_model


pytestmark = pytest.mark.vllm
HIDDEN = 128  # 4 heads of 32


def greedy_pair(trainer, tokenizer, prompts):
    """(transformers' greedy `generate`, vLLM's greedy completions) on the trainer's current policy."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    config = trainer.make_generation_config(do_sample=False)
    engine = trainer._synced_vllm_engine()
    ours = generate_batched(policy, tokenizer, prompts, generation_config=config, lean_decoding=False)
    theirs = generate_batched(policy, tokenizer, prompts, generation_config=config, vllm=engine)
    return ours.completion_ids_list, theirs.completion_ids_list


def assert_trained_and_equal(trainer, tokenizer, before):
    policy = trainer.accelerator.unwrap_model(trainer.model)
    changed = [n for n, p in policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "no trainable parameter changed"
    ours, theirs = greedy_pair(trainer, tokenizer, list(PROMPTS[:6]))
    assert ours == theirs


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_colocate_greedy_equals_generate_after_training(peft, tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN)
    args = grpo_args(tmp_path, use_vllm=True, num_generations=4, max_completion_length=8, max_steps=3)
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear") if peft else None
    trainer = GRPOTrainer(
        model, varied_reward, args=args, train_dataset=prompt_dataset(), processing_class=tokenizer,
        peft_config=peft_config,
    )  # fmt: skip
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert_trained_and_equal(trainer, tokenizer, before)
    logs = [log for log in trainer.state.log_history if "sampling/sampling_logp_difference/max" in log]
    assert len(logs) == 3
    for log in logs:  # fp32 on both sides: vLLM's log-probs are the trainer's up to kernel rounding
        assert log["sampling/sampling_logp_difference/max"] < 1e-3
        assert abs(log["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3


def test_generative_eval_runs_on_vllm(tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN)
    eval_rows = Dataset.from_dict({"prompt": list(PROMPTS[:4]), "answer": ["a"] * 4})
    args = rloo_args(tmp_path, use_vllm=True, num_generations=2, eval_strategy="steps", eval_steps=2, max_steps=2,
                     per_device_eval_batch_size=2, eval_max_new_tokens=4)  # fmt: skip
    trainer = RLOOTrainer(model, count_a, args=args, train_dataset=prompt_dataset(), eval_dataset=eval_rows,
                          processing_class=tokenizer)  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_accuracy" in metrics


def test_two_processes_each_with_an_engine(tmp_path):
    launch([os.path.join(ROOT, "tests", "jobs", "run_vllm_ddp.py"), str(tmp_path)], timeout=900)
    for rank in (0, 1):
        result = json.load(open(tmp_path / f"rank{rank}.json"))
        assert result["changed"] == result["total"], result
        assert result["equal"], (result["ours"], result["theirs"])


# ------------------------------------------------------------------ server mode
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model, tokenizer, folder):
    """`python -m vllm.entrypoints.openai.api_server` on loopback (the CPU build has no `vllm` console script),
    started from a checkpoint of `model`; on exit its whole process group is terminated."""
    path = save_tiny_model(model, tokenizer, str(folder / "model"))
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
           "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
           "--gpu-memory-utilization", "0.3"]  # fmt: skip
    with open(folder / "server.log", "w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield port, server
        finally:
            stop_group(server)


def group_alive(pid) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_group(server, grace=60.0):
    """SIGTERM to the server's process group, then wait until every process of it has exited (SIGKILL after
    `grace` seconds)."""
    os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while group_alive(server.pid) and time.monotonic() < deadline:
        server.poll()
        time.sleep(0.5)
    if group_alive(server.pid):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(30)


def test_server_mode_trains_syncs_and_shuts_down(tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=1)
    with vllm_server(model, tokenizer, tmp_path) as (port, server):
        args = grpo_args(
            tmp_path, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
            vllm_server_timeout=240, num_generations=4, max_completion_length=8, max_steps=2,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model, varied_reward, args=args, train_dataset=prompt_dataset(), processing_class=tokenizer
        )
        before = {n: p.clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        assert_trained_and_equal(trainer, tokenizer, before)
        assert (tmp_path / "grpo" / "vllm-weights" / "model.safetensors").exists()  # what the server reloaded
    assert server.returncode is not None and not group_alive(server.pid)  # the server and its engine are gone


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_online_dpo_trains_on_vllm_and_ends_equal_to_generate(mode, tokenizer, tmp_path):
    """TRL's two vLLM tests of its online DPO suite (colocate, server), through our engine: pairs sampled by vLLM,
    the policy trained, and vLLM's greedy output after training equal to transformers' `generate`."""
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=2)
    with contextlib.ExitStack() as stack:
        server_args = {}
        if mode == "server":
            port, _ = stack.enter_context(vllm_server(model, tokenizer, tmp_path))
            server_args = dict(vllm_server_host="127.0.0.1", vllm_server_port=port, vllm_server_timeout=240)
        args = tiny_run_args(OnlineDPOConfig, tmp_path / "online_dpo", use_vllm=True, vllm_mode=mode, max_steps=2,
                             per_device_train_batch_size=2, max_new_tokens=8, **server_args)  # fmt: skip
        trainer = OnlineDPOTrainer(model, reward_funcs=varied_reward, args=args, train_dataset=prompt_dataset(),
                                   processing_class=tokenizer)  # fmt: skip
        assert trainer.use_vllm and trainer.vllm_mode == mode
        before = {n: p.clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        assert_trained_and_equal(trainer, tokenizer, before)
        assert [log["step"] for log in trainer.state.log_history if "loss" in log] == [1, 2]


# ------------------------------------------------------------------ learning
@pytest.mark.parametrize("trainer_name", ["rloo", "grpo"])
def test_online_trainers_learn_with_vllm(trainer_name, tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=0)
    common = dict(use_vllm=True, max_steps=60, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=12, learning_rate=3e-3, beta=0.0, seed=0, logging_steps=1)  # fmt: skip
    if trainer_name == "rloo":
        trainer = RLOOTrainer(model, count_a, args=rloo_args(tmp_path, **common), train_dataset=prompt_dataset(64),
                              processing_class=tokenizer)  # fmt: skip
    else:
        trainer = GRPOTrainer(model, count_a, args=grpo_args(tmp_path, **common), train_dataset=prompt_dataset(64),
                              processing_class=tokenizer)  # fmt: skip
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.3, rewards


def test_ppo_learns_with_vllm(tokenizer, tmp_path):
    policy = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=0)
    args = tiny_run_args(
        PPOConfig, tmp_path / "ppo", max_steps=UNSET, use_vllm=True, per_device_train_batch_size=16,
        num_ppo_epochs=2, response_length=12, stop_token=None, total_episodes=16 * 50, learning_rate=3e-3,
        kl_coef=0.0, vf_coef=0.5, logging_steps=2, num_sample_generations=0,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": list(PROMPTS) * 8})
    trainer = PPOTrainer(args, tokenizer, policy, None, None, dataset, build_sequence_classifier(tokenizer),
                         reward_funcs=count_a)  # fmt: skip
    trainer.train()
    rewards = [log["objective/scores"] for log in trainer.state.log_history if "objective/scores" in log]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards


# ------------------------------------------------------------------ bad input
def test_tensor_parallel_beyond_the_processes_is_named(tokenizer, tmp_path):
    args = grpo_args(tmp_path, use_vllm=True, vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size=2 must divide the number of training processes"):
        GRPOTrainer(build_causal_lm(tokenizer, hidden_size=HIDDEN), count_a, args=args,
                    train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip


def test_an_architecture_vllm_lacks_is_named(tokenizer, tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64))  # fmt: skip
    model.config.architectures = ["NoSuchArchitectureForCausalLM"]
    args = grpo_args(tmp_path, use_vllm=True)
    with pytest.raises(ValueError, match=r"vLLM has no implementation of \['NoSuchArchitectureForCausalLM'\]"):
        GRPOTrainer(model, count_a, args=args, train_dataset=prompt_dataset(), processing_class=tokenizer)
