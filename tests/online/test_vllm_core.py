"""The vLLM engine's trainer side, without vLLM: the importance-sampling correction against hand computations, the
sampling settings, groups sent once, weight sync once per optimiser step, and server-mode errors. A stand-in engine
(the policy's own generation, log-probs shifted by a known amount) plays vLLM; the real engine is tests/vllm."""

import math
import socket
import time

import pytest
import torch
from transformers import GenerationConfig

from tests.helpers import grpo_args, prompt_dataset, rloo_args, varied_reward
from trl_unified import GRPOTrainer
from trl_unified.generation import generate_batched
from trl_unified.generation.vllm_engine import VLLMEngine, group_runs, sampling_settings
from trl_unified.generation.vllm_server import VLLMServerEngine
from trl_unified.online.importance_sampling import importance_sampling_ratio, mismatch_metrics
from trl_unified.testing import build_causal_lm


OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, -9.0]])
SAMPLED = torch.tensor([[-1.5, -1.0, float("nan")], [-0.2, -0.1, -1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_ratio_per_mode_by_hand():
    # diffs (old - sampled) * mask, NaN -> 0:  row 0: [0.5, -1.0, 0];  row 1: [0, -0.2, 0 (masked)]
    token = torch.exp(torch.tensor([[0.5, -1.0, 0.0], [0.0, -0.2, 0.0]]))
    sequence = torch.exp(torch.tensor([[-0.5], [-0.2]]))
    ratio = importance_sampling_ratio(OLD, SAMPLED, MASK, "token_truncate", None, 1.5)
    torch.testing.assert_close(ratio, token.clamp(max=1.5))
    ratio = importance_sampling_ratio(OLD, SAMPLED, MASK, "token_mask", 0.5, 1.5)
    expected = token.clone()
    expected[0, 1] = 0.0  # exp(-1) = 0.37 < 0.5
    expected[0, 0] = 0.0 if math.exp(0.5) > 1.5 else expected[0, 0]  # exp(0.5) = 1.65 > 1.5
    torch.testing.assert_close(ratio, expected)
    torch.testing.assert_close(
        importance_sampling_ratio(OLD, SAMPLED, MASK, "sequence_truncate", 0.7, 3.0), sequence.clamp(0.7, 3.0)
    )
    ratio = importance_sampling_ratio(OLD, SAMPLED, MASK, "sequence_mask", 0.7, 3.0)
    torch.testing.assert_close(ratio, torch.tensor([[0.0], [math.exp(-0.2)]]))  # exp(-0.5) = 0.61 < 0.7
    with pytest.raises(ValueError, match="Unknown vLLM importance sampling mode 'tokens'"):
        importance_sampling_ratio(OLD, SAMPLED, MASK, "tokens")


def test_mismatch_metrics_by_hand():
    ratio = importance_sampling_ratio(OLD, SAMPLED, MASK, "token_truncate", None, 3.0)
    stats = mismatch_metrics(OLD, SAMPLED, MASK, ratio, "token_truncate")
    deltas = [0.5, 1.0, 0.0, 0.2]  # |old - sampled| on masked tokens vLLM scored (the NaN one is left out)
    assert stats["sampling/sampling_logp_difference/mean"].item() == pytest.approx(sum(deltas) / 4)
    assert stats["sampling/sampling_logp_difference/max"].item() == pytest.approx(1.0)
    masked = [math.exp(0.5), math.exp(-1.0), 1.0, 1.0, math.exp(-0.2)]  # the 5 masked tokens
    assert stats["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(sum(masked) / 5)
    assert stats["sampling/importance_sampling_ratio/min"].item() == pytest.approx(math.exp(-1.0))
    sequence = importance_sampling_ratio(OLD, SAMPLED, MASK, "sequence_truncate", None, 3.0)
    stats = mismatch_metrics(OLD, SAMPLED, MASK, sequence, "sequence_truncate")
    assert stats["sampling/importance_sampling_ratio/max"].item() == pytest.approx(math.exp(-0.2))


def test_groups_are_sent_once_and_settings_follow_the_generation_config():
    assert group_runs([[1, 2], [1, 2], [3], [1, 2]]) == [([1, 2], 2), ([3], 1), ([1, 2], 1)]
    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=4, eos_token_id=2)
    settings = sampling_settings(config, [2, 7])
    assert settings == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": 4,
        "stop_token_ids": [2, 7], "logprobs": 0,
    }  # fmt: skip
    greedy = sampling_settings(GenerationConfig(do_sample=False, temperature=0.7, max_new_tokens=4), [2])
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0
    with pytest.raises(ValueError, match="beam search"):
        sampling_settings(GenerationConfig(num_beams=2, max_new_tokens=4), [2])


class StandInEngine(VLLMEngine):
    """vLLM's place: the policy's own sampling (a copy of its weights taken at each sync), log-probs shifted."""

    mode = "server"
    shift = 0.1

    def __init__(self, args, model, tokenizer, lean_decoding=True):
        super().__init__(args)
        self.tokenizer, self.syncs, self.requests, self.lean_decoding = tokenizer, [], [], lean_decoding

    def sync_weights(self, model, accelerator):
        self.syncs.append(self.synced)
        self.model = model

    def generate(self, prompt_ids, generation_config, eos_token_ids):
        self.requests.append(group_runs(prompt_ids))
        out = generate_batched(
            self.model, self.tokenizer, prompt_ids, generation_config, eos_token_ids=eos_token_ids,
            return_logprobs=True, lean_decoding=self.lean_decoding,
        )  # fmt: skip
        completions = [row[mask.bool()] for row, mask in zip(out.completion_ids, out.completion_mask)]
        if out.logprobs is None:  # model.generate decoded (a scripted model): no log-probs, as an engine without them
            return completions, [torch.full((len(c),), float("nan")) for c in completions]
        logprobs = [row[mask.bool()] - self.shift for row, mask in zip(out.logprobs, out.completion_mask)]
        return completions, logprobs


def test_trainer_applies_the_correction_logs_trl_metrics_and_syncs_once_per_step(tokenizer, tmp_path, monkeypatch):
    engines = []

    def stand_in(args, model, accelerator):
        engines.append(StandInEngine(args, model, tokenizer))
        return engines[-1]

    monkeypatch.setattr(VLLMEngine, "from_args", staticmethod(stand_in))
    args = grpo_args(
        tmp_path, use_vllm=True, vllm_mode="server", vllm_importance_sampling_mode="token_truncate",
        max_steps=3, num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    )  # fmt: skip
    trainer = GRPOTrainer(
        build_causal_lm(tokenizer),
        varied_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    trainer.train()
    engine = engines[0]
    # one generation round per optimiser step (steps_per_generation = GA = 2): synced before each, once
    assert len(engine.syncs) == 3 and engine.synced == (id(trainer), 2)
    # each prompt of a round reaches the engine once with n = G (8 rows = 2 prompts x 4)
    assert all([n for _, n in runs] == [4, 4] for runs in engine.requests)
    logged = [log for log in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in log]
    assert len(logged) == 3
    for log in logged:  # log pi_old - log pi_engine = 0.1 on every token the policy sampled
        assert log["sampling/sampling_logp_difference/mean"] == pytest.approx(0.1, abs=1e-5)
        for stat in ("min", "mean", "max"):
            assert log[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(math.exp(0.1), abs=1e-5)


def test_correction_multiplies_the_per_token_loss(tokenizer, tmp_path, monkeypatch):
    """GRPO's loss with the ratio w: with a constant w per token, the (token-normalised) loss scales by w exactly."""
    monkeypatch.setattr(VLLMEngine, "from_args", staticmethod(lambda a, m, acc: StandInEngine(a, m, tokenizer)))
    args = grpo_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer(
        build_causal_lm(tokenizer),
        varied_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; the loss is called directly here
    batch = trainer.rollout([{"prompt": p} for p in prompt_dataset(4)["prompt"]])
    torch.testing.assert_close(
        batch.importance_sampling_ratio[batch.loss_mask.bool()],
        torch.full((int(batch.loss_mask.sum()),), math.exp(0.1)),
    )
    with torch.no_grad():
        corrected = trainer.compute_policy_loss(trainer.model, batch)
        batch.importance_sampling_ratio = None
        plain = trainer.compute_policy_loss(trainer.model, batch)
    torch.testing.assert_close(corrected, plain * math.exp(0.1))


def test_server_mode_without_a_server_fails_within_the_timeout(tokenizer, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = grpo_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port,
                     vllm_server_timeout=2.0)  # fmt: skip
    start = time.monotonic()
    with pytest.raises(
        ConnectionError, match=rf"vLLM server at http://127.0.0.1:{port} did not answer /health within"
    ):
        GRPOTrainer(build_causal_lm(tokenizer), varied_reward, args=args, train_dataset=prompt_dataset(),
                    processing_class=tokenizer)  # fmt: skip
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(vllm_mode="remote"), ValueError, "vllm_mode='remote' must be 'colocate' or 'server'"),
        (dict(vllm_mode="server", vllm_group_port=1234), NotImplementedError, "vllm_group_port=1234 is the port"),
        (dict(vllm_mode="server", use_transformers_continuous_batching=True), ValueError, "not both"),
    ],
)
def test_bad_vllm_settings_are_named_before_training(overrides, error, match, tokenizer, tmp_path):
    with pytest.raises(error, match=match):
        args = grpo_args(tmp_path, use_vllm=True, **overrides)
        GRPOTrainer(build_causal_lm(tokenizer), varied_reward, args=args, train_dataset=prompt_dataset(),
                    processing_class=tokenizer)  # fmt: skip


def test_server_engine_is_constructible_without_vllm_installed():
    assert VLLMServerEngine.mode == "server"  # server mode speaks HTTP only: no vLLM import in the trainer process


def test_tool_loop_turns_are_generated_by_the_engine(tmp_path, monkeypatch):
    """With use_vllm=True the tool loop's turns go through the engine (one sync for the whole round); tool-result
    tokens are masked, and tokens without engine log-probs get the ratio 1 (TRL's NaN rule)."""
    from tests.online.test_agents import MULTIPLY_CALL, agent_args, conversations, multiply, record_rewards, script
    from trl_unified.testing import build_tool_tokenizer

    tool_tokenizer = build_tool_tokenizer()
    engines = []

    def stand_in(args, model, accelerator):
        engines.append(StandInEngine(args, model, tool_tokenizer, lean_decoding=False))
        return engines[-1]

    monkeypatch.setattr(VLLMEngine, "from_args", staticmethod(stand_in))
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"), record_rewards([]),
        args=agent_args(tmp_path, use_vllm=True, vllm_mode="server"), train_dataset=conversations(),
        processing_class=tool_tokenizer, tools=[multiply],
    )  # fmt: skip
    trainer.model.generate, calls = script(tool_tokenizer, [[MULTIPLY_CALL, "No<|im_end|>", "No<|im_end|>"],
                                                            ["Done!<|im_end|>"]])  # fmt: skip
    trainer.model.train()
    batch = trainer._prepare_inputs([dict(row) for row in [trainer.train_dataset[0]] * 3])
    assert calls == [3, 1] and len(engines[0].syncs) == 1  # two turns, one sync
    assert [len(runs) for runs in engines[0].requests] == [1, 1]  # the group of 3 sent once, then the one continuation
    assert batch.tool_mask is not None and (batch.tool_mask == 0).any()
    torch.testing.assert_close(batch.importance_sampling_ratio, torch.ones_like(batch.importance_sampling_ratio))


def test_vespo_needs_a_token_level_correction_and_unknown_generation_kwargs_are_named(tmp_path):
    with pytest.raises(ValueError, match="VESPO loss requires `vllm_importance_sampling_mode`"):
        grpo_args(tmp_path, use_vllm=True, vllm_mode="server", loss_type="vespo")
    grpo_args(
        tmp_path, use_vllm=True, vllm_mode="server", loss_type="vespo", vllm_importance_sampling_mode="token_mask"
    )
    from trl_unified.generation.vllm_engine import engine_generation_kwargs

    args = grpo_args(tmp_path, generation_kwargs={"stop": ["</answer>"], "seed": 3, "no_repeat_ngram_size": 2})
    assert engine_generation_kwargs(args) == {"stop": ["</answer>"], "seed": 3}  # the last is GenerationConfig's
    with pytest.raises(ValueError, match=r"generation_kwargs \['frobnicate'\] are neither vLLM sampling parameters"):
        engine_generation_kwargs(grpo_args(tmp_path, generation_kwargs={"frobnicate": 1}))


def test_the_correction_applies_to_grpo_with_vllm_only(tokenizer, tmp_path, monkeypatch):
    """GRPO with vLLM corrects by default (and then computes π_old in both modes, as TRL); GRPO without vLLM, with the
    correction off, and RLOO (which has no correction) do not: each trainer's own `rollout_plan` says so."""
    from trl_unified import RLOOTrainer
    from trl_unified.online.rollout import RolloutPlan

    monkeypatch.setattr(VLLMEngine, "from_args", staticmethod(lambda a, m, acc: StandInEngine(a, m, tokenizer)))

    def plan(trainer_class, **overrides):
        make_args = rloo_args if trainer_class is RLOOTrainer else grpo_args
        args = make_args(tmp_path, per_device_train_batch_size=4, num_generations=2, **overrides)
        model = build_causal_lm(tokenizer)
        trainer = trainer_class(
            model, varied_reward, args=args, train_dataset=prompt_dataset(), processing_class=tokenizer
        )
        return getattr(trainer, "corrects_sampling", False), trainer.plan

    vllm = dict(use_vllm=True, vllm_mode="server")
    assert plan(GRPOTrainer, **vllm) == (True, RolloutPlan(True, True))
    assert plan(GRPOTrainer) == (False, RolloutPlan.trl(grpo_args(tmp_path)))
    assert plan(GRPOTrainer, vllm_importance_sampling_correction=False, **vllm)[0] is False
    corrects, rloo_plan = plan(RLOOTrainer, **vllm)
    assert not corrects and not rloo_plan.old_logps_train  # RLOO's own rule: one pass, one step per round
