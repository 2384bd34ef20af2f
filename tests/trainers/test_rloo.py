import asyncio
import dataclasses
import math
import time

import pytest
import torch
import trl
from datasets import Dataset, IterableDataset

from tests.helpers import prompt_dataset, rloo_args, varied_reward
from trl_unified import RLOOConfig, RLOOTrainer, rloo_advantages
from trl_unified.generation.vllm_engine import vllm_available
from trl_unified.trainers.rloo import nanstd


# ------------------------------------------------------------------ maths
def test_rloo_advantages_match_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 2.0, 3.0, 3.0, 3.0])  # 2 prompts, G=3
    # 1-(0+2)/2=0, 0-(1+2)/2=-1.5, 2-(1+0)/2=1.5; equal rewards give 0
    expected = torch.tensor([0.0, -1.5, 1.5, 0.0, 0.0, 0.0])
    torch.testing.assert_close(rloo_advantages(rewards, num_generations=3), expected)
    # closed form: G/(G-1) * (r - mean)
    torch.testing.assert_close(
        rloo_advantages(rewards, 3), 1.5 * (rewards - rewards.view(2, 3).mean(1).repeat_interleave(3))
    )


def test_rloo_advantages_skip_unscorable_rows():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 5.0, float("nan"), float("nan")])
    adv = rloo_advantages(rewards, 3)
    # group 1: scorable {1, 3}: 1-3=-2, 3-1=2; group 2: a single scorable reward has no baseline
    torch.testing.assert_close(adv[[0, 2]], torch.tensor([-2.0, 2.0]))
    assert torch.isnan(adv[[1, 3, 4, 5]]).all()


def test_nanstd_is_bessel_corrected_and_ignores_nan():
    x = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    torch.testing.assert_close(nanstd(x), torch.tensor([1.0, 2.0, 4.0]).std())
    assert torch.isnan(nanstd(torch.tensor([1.0, float("nan")])))


def test_kl_shaping_and_normalisation_in_trainer(llama_path, tmp_path):
    trainer = RLOOTrainer(
        llama_path,
        varied_reward,
        args=rloo_args(tmp_path, beta=0.5, normalize_advantages=True, reward_clip_range=(0.0, 2.0)),
        train_dataset=prompt_dataset(),
    )
    rewards = torch.tensor([1.0, 3.0, 0.0, 2.0])  # 3.0 is clipped to 2.0
    kl = torch.tensor([0.2, 0.0, 1.0, 0.0])
    loo = torch.tensor([0.9 - 2.0, 2.0 - 0.9, -0.5 - 2.0, 2.0 + 0.5])  # shaped r - 0.5 kl = [0.9, 2.0, -0.5, 2.0]
    expected = (loo - loo.mean()) / (loo.std() + 1e-4)
    torch.testing.assert_close(trainer._advantages(rewards, kl, "train"), expected)


# ------------------------------------------------------------------ config
def test_config_has_every_trl_field_with_the_same_default():
    ours = {f.name: f for f in dataclasses.fields(RLOOConfig)}
    for f in dataclasses.fields(trl.RLOOConfig):
        assert f.name in ours, f.name
        if f.default is not dataclasses.MISSING:
            assert ours[f.name].default == f.default, (f.name, ours[f.name].default, f.default)
        else:
            assert ours[f.name].default_factory() == f.default_factory(), f.name


def test_config_fields_are_documented_once():
    doc = RLOOConfig.__doc__
    for f in dataclasses.fields(RLOOConfig):
        if f.name in RLOOConfig.__dataclass_fields__ and f.metadata.get("help"):
            continue
        assert f.name.startswith("_") or f.metadata.get("help"), f"{f.name} has no help"
    for name in ("beta", "num_generations", "answer_extractor"):
        help_text = RLOOConfig.__dataclass_fields__[name].metadata["help"]
        assert f"{name} (`" in doc and help_text in doc, name


# use_vllm, use_transformers_continuous_batching and the bad config values are cases of tests/test_bad_input.py.
def test_use_vllm_without_vllm_names_the_extra_and_vllm_only_fields_are_ignored(llama_path, tmp_path):
    if vllm_available():
        pytest.skip("vLLM is installed here (the vllm group covers use_vllm=True)")
    args = rloo_args(tmp_path, use_vllm=True)  # a config builds anywhere, as TRL's
    with pytest.raises(ImportError, match=r"needs vLLM, which is not installed: pip install 'trl_unified\[vllm\]'"):
        RLOOTrainer(llama_path, varied_reward, args=args, train_dataset=prompt_dataset())  # before any training
    assert RLOOConfig(output_dir=str(tmp_path), vllm_mode="server").vllm_mode == "server"  # warned, no effect


# ------------------------------------------------------------------ training
def test_training_changes_every_parameter_and_logs_trl_metrics(llama_path, tmp_path):
    trainer = RLOOTrainer(
        llama_path, varied_reward, args=rloo_args(tmp_path, beta=0.1, max_steps=3), train_dataset=prompt_dataset()
    )
    assert (trainer.use_vllm, trainer.vllm_mode) == (False, "colocate")  # TRL's attributes (plain, assignable)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, p in trainer.model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not change"
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["step"] for log in steps] == [1, 2, 3]
    max_entropy = math.log(trainer.model.config.vocab_size)
    for logs in steps:
        assert all(math.isfinite(v) for v in logs.values()), logs
        # num_iterations=1: ratio = 1, so the loss is -mean(advantage) = 0 (leave-one-out advantages sum to 0)
        assert logs["loss"] == pytest.approx(0.0, abs=1e-6)
        for name in ("low_mean", "low_min", "high_mean", "high_max", "region_mean"):
            assert logs[f"clip_ratio/{name}"] == 0.0, name
        assert 1 <= logs["completions/min_length"] <= logs["completions/mean_length"] <= 6
        assert logs["completions/max_length"] <= 6 and 0 <= logs["completions/clipped_ratio"] <= 1
        assert 0 <= logs["rewards/varied_reward/mean"] <= 6 / 7 and logs["rewards/varied_reward/std"] >= 0
        assert logs["reward"] == logs["rewards/varied_reward/mean"]  # one function, weight 1
        assert logs["reward_std"] == logs["rewards/varied_reward/std"]
        assert logs["frac_reward_zero_std"] in (0.0, 0.5, 1.0)  # 2 groups of 2 per step
        assert 0 < logs["entropy"] <= max_entropy + 1e-4
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert all(abs(log["kl"]) > 1e-4 for log in steps[1:])  # and moves away from it
    tokens = [log["num_tokens"] for log in steps]  # a running total of prompt + completion tokens
    assert 0 < tokens[0] < tokens[1] < tokens[2] == trainer.state.num_input_tokens_seen


def test_conversational_prompts_extra_columns_and_reward_kwargs(llama_path, tmp_path):
    seen, custom = {}, []

    def reward(prompts, completions, completion_ids, target, trainer_state, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, target=target, step=trainer_state.global_step)
        custom.append(sum(len(c[0]["content"]) for c in completions) / len(completions))
        log_metric("custom/len", custom[-1])
        return [float(len(ids)) for ids in completion_ids]

    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p}] for p in ["a b", "c d", "e", "f g"]] * 2,
            "target": ["x", "y", "z", "w"] * 2,
        }
    )
    trainer = RLOOTrainer(llama_path, reward, args=rloo_args(tmp_path, beta=0.0), train_dataset=data)
    trainer.train()
    assert seen["completions"][0][0]["role"] == "assistant"
    assert isinstance(seen["prompts"][0], list) and len(seen["target"]) == 4
    assert all(t in "xyzw" for t in seen["target"])
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert len(custom) == len(steps) == 2  # one reward call per step, one log per step
    assert [log["custom/len"] for log in steps] == pytest.approx(custom)
    for log in steps:  # the reward is each completion's token count: its mean is the mean completion length
        assert log["rewards/reward/mean"] == pytest.approx(log["completions/mean_length"])


def test_async_reward_functions_run_concurrently(llama_path, tmp_path):
    spans = []

    def make(name):
        async def reward(completions, **kwargs):
            start = time.perf_counter()
            await asyncio.sleep(0.2)
            spans.append((start, time.perf_counter()))
            return [1.0] * len(completions)

        reward.__name__ = name
        return reward

    trainer = RLOOTrainer(
        llama_path,
        [make("slow1"), make("slow2"), varied_reward],
        args=rloo_args(tmp_path, max_steps=1),
        train_dataset=prompt_dataset(),
    )
    trainer.train()
    (s1, e1), (s2, e2) = spans[:2]
    assert s2 < e1 and s1 < e2  # the two sleeps overlapped
    assert trainer.state.log_history[0]["rewards/slow1/mean"] == 1.0


def test_reward_model_by_path_none_rewards_and_weights(llama_path, reward_model_path, tmp_path):
    def sometimes_none(completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    trainer = RLOOTrainer(
        llama_path,
        [reward_model_path, sometimes_none],
        args=rloo_args(tmp_path, reward_weights=[0.5, 2.0], max_steps=1),
        train_dataset=prompt_dataset(),
    )
    assert trainer.rewards.names == ["reward", "sometimes_none"]
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["rewards/sometimes_none/mean"] == 1.0  # None rows are ignored, not counted as 0
    assert math.isfinite(logs["rewards/reward/mean"]) and logs["rewards/reward/std"] > 0
    # Per row 0.5 * model + 2.0 * 1.0 (even rows) or 0.5 * model (odd rows, None skipped): mean 0.5 * model + 1.0
    assert logs["reward"] == pytest.approx(0.5 * logs["rewards/reward/mean"] + 1.0, abs=1e-6)


def test_iterable_dataset(llama_path, tmp_path):
    prompts = ["a b", "c", "d e f", "g"]
    seen, scores = [], []

    def reward(prompts, completions, **kwargs):
        seen.extend(prompts)
        scores.append(varied_reward(completions))
        return scores[-1]

    data = IterableDataset.from_generator(lambda: ({"prompt": p} for p in prompts * 8))
    trainer = RLOOTrainer(llama_path, reward, args=rloo_args(tmp_path, max_steps=2), train_dataset=data)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    for name, p in trainer.model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} did not change"
    assert len(seen) == 8 and set(seen) <= set(prompts)  # 2 steps x 4 completions, from the stream's rows
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["step"] for log in steps] == [1, 2]
    max_entropy = math.log(trainer.model.config.vocab_size)
    for log, step_scores in zip(steps, scores, strict=True):  # one generation (one reward call) per step
        # num_iterations=1: ratio = 1, so the loss is -mean(advantage) = 0 (leave-one-out advantages sum to 0)
        assert log["loss"] == pytest.approx(0.0, abs=1e-6) and 0 < log["entropy"] <= max_entropy + 1e-4
        assert log["reward"] == log["rewards/reward/mean"] == pytest.approx(sum(step_scores) / 4, abs=1e-6)


def test_eval_metrics_have_eval_prefix(llama_path, tmp_path):
    trainer = RLOOTrainer(
        llama_path,
        varied_reward,
        args=rloo_args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=prompt_dataset(),
        eval_dataset=prompt_dataset(8),
    )
    metrics = trainer.evaluate()
    assert not any(k.startswith(("reward", "completions/", "entropy", "kl")) for k in metrics), metrics
    assert metrics["eval_loss"] == pytest.approx(0.0, abs=1e-6)  # ratio 1, leave-one-out advantages sum to 0
    assert (
        0 <= metrics["eval_reward"] <= 6 / 7 and metrics["eval_reward"] == metrics["eval_rewards/varied_reward/mean"]
    )
    assert 1 <= metrics["eval_completions/mean_length"] <= 6
    assert 0 < metrics["eval_entropy"] <= math.log(trainer.model.config.vocab_size) + 1e-4


def test_no_extra_forward_when_generation_is_aligned(llama_path, tmp_path):
    """num_iterations=1 and steps_per_generation == gradient accumulation: one policy forward per micro-step (the
    loss's); TRL runs a second, no-grad forward for the old log-probs. With num_iterations=2 the old log-probs are
    needed and computed once per generation."""

    def policy_forwards(**kwargs):
        trainer = RLOOTrainer(
            llama_path,
            varied_reward,
            # forward calls are counted: plain forwards (shared prefixes split one forward in two calls)
            args=rloo_args(tmp_path, max_steps=2, beta=0.1, shared_prefix=False, padding_free=False, **kwargs),
            train_dataset=prompt_dataset(),
        )
        state = {"generating": False, "forwards": 0}
        trainer.model.register_forward_hook(
            lambda *a: state.update(forwards=state["forwards"] + (not state["generating"]))
        )
        generate = trainer.model.generate

        def counting_generate(*args, **kw):
            state["generating"] = True
            try:
                return generate(*args, **kw)
            finally:
                state["generating"] = False

        trainer.model.generate = counting_generate
        trainer.train()
        return state["forwards"]

    assert policy_forwards() == 2  # 2 steps x 1 loss forward
    assert policy_forwards(num_iterations=2) == 3  # 1 generation: 1 old-log-prob forward + 2 loss forwards


def test_log_completions_prints_samples_with_extra_columns(llama_path, tmp_path, capsys):
    def reward(completions, log_extra, **kwargs):
        log_extra("judge_note", [f"len={len(c)}" for c in completions])
        return [float(len(c)) for c in completions]

    trainer = RLOOTrainer(
        llama_path,
        reward,
        args=rloo_args(tmp_path, max_steps=1, log_completions=True, num_completions_to_print=2),
        train_dataset=prompt_dataset(),
    )
    trainer.train()
    out = capsys.readouterr().out
    assert out.count("reward=") == 2 and "judge_note: len=" in out and "completion:" in out


def test_vision_language_policy_with_images(tmp_path):
    from trl_unified.testing import build_image, build_vision_language_model

    model, processor = build_vision_language_model()
    rows = [
        {"prompt": [{"role": "user", "content": "describe the image" if i % 2 else "a b"}], "image": build_image(i)}
        for i in range(8)
    ]
    trainer = RLOOTrainer(
        model,
        varied_reward,
        args=rloo_args(tmp_path, beta=0.1, max_steps=2),
        train_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith("model.visual") for n in changed) and len(changed) == len(before)
    steps = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["step"] for log in steps] == [1, 2]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert math.isfinite(steps[1]["kl"]) and abs(steps[1]["kl"]) > 1e-6  # one update later it differs


def test_vision_language_logprobs_follow_greedy_generation():
    """Left padding, images and M-RoPE positions line up: each greedy token is the argmax of the scored logits."""
    from transformers import GenerationConfig
    from trl import prepare_multimodal_messages

    from trl_unified import RolloutBatch, compute_token_logprobs, generate_batched
    from trl_unified.testing import build_image, build_vision_language_model

    model, processor = build_vision_language_model()
    prompts = [
        prepare_multimodal_messages([{"role": "user", "content": t}], images=[build_image(i)])
        for i, t in enumerate(["a", "which image is larger ? a b c d"])
    ]
    config = GenerationConfig(
        max_new_tokens=4,
        do_sample=False,
        eos_token_id=processor.tokenizer.eos_token_id,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    out = generate_batched(model, processor, prompts, config, images=[[build_image(0)], [build_image(1)]])
    batch = RolloutBatch(
        prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
        completion_mask=out.completion_mask, rewards=torch.zeros(2), row_index=torch.arange(2),
        is_truncated=out.is_truncated, visual_inputs=out.visual_inputs, prompt_token_inputs=out.prompt_token_inputs,
    )  # fmt: skip
    ids, mask, extra = batch.model_inputs()  # per-row images concatenated, per-token inputs zero-extended
    k = out.completion_ids.size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **extra).logits[:, -k - 1 : -1]
        logps = compute_token_logprobs(model, ids, mask, k, **extra).logps
    real = out.completion_mask.bool()
    assert torch.equal(logits.argmax(-1)[real], out.completion_ids[real])
    naive = torch.log_softmax(logits.float(), -1).gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logps[real], naive[real], rtol=1e-5, atol=1e-5)
