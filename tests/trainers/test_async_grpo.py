"""AsyncGRPOTrainer: TRL 1.16's config fields and constructor, its loss equal to TRL's `AsyncGRPOTrainer.compute_loss`
on fixed samples (losses and gradients to 1e-5), the importance-sampling option against a hand computation, and a
short run on the stand-in server (tests/online/test_async.py) that trains and logs TRL's metric names."""

import dataclasses
import inspect
import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from tests.helpers import prompt_dataset, tiny_run_args, varied_reward  # noqa: E402
from tests.online.test_async import producer_threads  # noqa: E402
from trl_unified import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl_unified.online.rollout import RolloutBatch  # noqa: E402
from trl_unified.testing import build_causal_lm  # noqa: E402


trl_async = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")
packing = pytest.importorskip("trl.experimental.async_grpo.packing")


def async_args(tmp_path, **overrides):
    defaults = dict(num_generations=2, max_completion_length=6, max_staleness=1, per_device_train_batch_size=4)
    return tiny_run_args(AsyncGRPOConfig, tmp_path / "async", **{**defaults, **overrides})


def test_config_has_every_trl_field_with_the_same_default():
    ours = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    for f in dataclasses.fields(trl_async.AsyncGRPOConfig):
        assert f.name in ours, f.name
        theirs = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        mine = (
            ours[f.name].default if ours[f.name].default is not dataclasses.MISSING else ours[f.name].default_factory()
        )
        assert mine == theirs, (f.name, mine, theirs)
    for name in ("max_staleness", "weight_sync_steps", "queue_maxsize"):
        assert f"{name} (`" in AsyncGRPOConfig.__doc__


def test_constructor_takes_trl_arguments_in_trl_order():
    theirs = list(inspect.signature(trl_async.AsyncGRPOTrainer.__init__).parameters)
    ours = list(inspect.signature(AsyncGRPOTrainer.__init__).parameters)
    assert ours[: len(theirs)] == theirs, (ours, theirs)


@pytest.mark.parametrize(
    "overrides, match",
    [(dict(use_vllm=False), "use_vllm and async_rollouts must stay True"), (dict(token_budget=512), "token_budget")],
)
def test_bad_settings_are_named(overrides, match, tmp_path):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        async_args(tmp_path, **overrides)


# ------------------------------------------------------------------ the loss, against TRL's code
def fixed_samples(tokenizer, generator):
    """2 prompts x G=2 completions of different lengths, engine log-probs near the policy's, mixed advantages."""
    prompts = [tokenizer("a b c")["input_ids"], tokenizer("d e")["input_ids"]]
    rows = []
    for i, completion_length in enumerate((4, 2, 3, 5)):
        completion = torch.randint(5, len(tokenizer), (completion_length,), generator=generator).tolist()
        logps = (-torch.rand(completion_length, generator=generator) * 3).tolist()
        rows.append((prompts[i // 2], completion, logps, [0.9, -0.9, 0.3, -0.3][i]))
    return rows


def trl_loss(model, rows, temperature, epsilon, epsilon_high):
    """TRL 1.16's `AsyncGRPOTrainer.compute_loss` on `rows` packed by TRL's own packer and collator, the fused head's
    log-probs and tree attention played by per-segment forwards of the same model (each segment attends to its
    root-to-segment path, as `tree_attention` does)."""
    tree = packing.TreeRow()
    for group, (prompt, completion, logps, advantage) in enumerate(rows):
        ids = torch.tensor(prompt + completion)
        mask = torch.tensor([0] * len(prompt) + [1] * len(completion))
        old = torch.tensor([0.0] * len(prompt) + logps)
        tree.add({"input_ids": ids, "completion_mask": mask, "old_log_probs": old, "advantage": advantage,
                  "group_id": group // 2})  # fmt: skip
    collator = trl_async.DataCollatorForRollout(pad_token_id=0)
    collator._log_metrics = lambda **kwargs: None
    inputs = collator.torch_call([[tree]])

    def model_stub(input_ids, position_ids, shift_labels, fused_lm_head, **tree):
        n = input_ids.size(1)
        log_probs, entropy = [None] * n, [None] * n
        q, k = tree["tree_cu_seqlens_q"].tolist(), tree["tree_cu_seqlens_k"].tolist()
        for s in range(len(q) - 1):
            path = tree["tree_kv_index"][k[s] : k[s + 1]]
            logits = model(input_ids=input_ids[:, path]).logits[0, -(q[s + 1] - q[s]) :] / temperature
            scores = torch.log_softmax(logits.float(), dim=-1)
            for j, position in enumerate(range(q[s], q[s + 1])):
                label = max(int(shift_labels[0, position]), 0)
                log_probs[position] = scores[j, label]
                entropy[position] = -(scores[j].exp() * scores[j]).sum()
        return SimpleNamespace(log_probs=torch.stack(log_probs)[None], entropy=torch.stack(entropy)[None])

    from accelerate import Accelerator

    harness = SimpleNamespace(
        epsilon_low=epsilon, epsilon_high=epsilon_high, aux_loss_enabled=False, current_gradient_accumulation_steps=1,
        accelerator=Accelerator(cpu=True), _metrics={"train": defaultdict(list)}, _step_forward_tokens=0.0,
        _step_trained_tokens=0.0, _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0,
    )  # fmt: skip
    return trl_async.AsyncGRPOTrainer.compute_loss(harness, model_stub, inputs), harness._metrics["train"]


def our_batch(rows, pad_id):
    width_p, width_c = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    left = [[pad_id] * (width_p - len(p)) + p for p, *_ in rows]
    right = [c + [pad_id] * (width_c - len(c)) for _, c, *_ in rows]
    return RolloutBatch(
        prompt_ids=torch.tensor(left),
        prompt_mask=torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p, *_ in rows]),
        completion_ids=torch.tensor(right),
        completion_mask=torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for _, c, *_ in rows]),
        rewards=torch.zeros(len(rows)),
        row_index=torch.arange(len(rows)),
        is_truncated=torch.zeros(len(rows), dtype=torch.bool),
        advantages=torch.tensor([r[3] for r in rows]),
        sampling_logps=torch.tensor([lp + [float("nan")] * (width_c - len(lp)) for _, _, lp, _ in rows]),
        num_loss_tokens=float(sum(len(r[1]) for r in rows)),
    )


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_loss_and_gradients_equal_trl_on_fixed_samples(epsilon_high, tokenizer, tmp_path, engines):
    args = async_args(tmp_path, temperature=0.7, epsilon_high=epsilon_high, max_steps=1)
    trainer = AsyncGRPOTrainer(build_causal_lm(tokenizer), varied_reward, args, prompt_dataset(), tokenizer)
    model = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    rows = fixed_samples(tokenizer, torch.Generator().manual_seed(0))
    theirs, trl_metrics = trl_loss(model, rows, 0.7, 0.2, epsilon_high or 0.2)
    trl_grads = torch.autograd.grad(theirs, list(model.parameters()))
    ours = trainer.compute_policy_loss(model, our_batch(rows, tokenizer.pad_token_id))
    our_grads = torch.autograd.grad(ours, list(model.parameters()))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for mine, reference in zip(our_grads, trl_grads, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    for name in ("ratio", "kl", "entropy", "clip_ratio/region_mean"):
        assert trainer._metrics["train"][name][-1] == pytest.approx(trl_metrics[name][-1], abs=1e-5), name


def test_the_importance_sampling_option_equals_a_hand_computation(tokenizer, tmp_path, engines):
    """With vllm_importance_sampling_correction, π_old is recomputed at consumption and the per-token loss is
    multiplied by w = clamp(exp(log π_old - log π_sampling), max=3) (token_truncate): with π_old = π_θ (one pass),
    L = sum_t -A_i w_t / (N / P)."""
    args = async_args(
        tmp_path, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate"
    )
    trainer = AsyncGRPOTrainer(build_causal_lm(tokenizer), varied_reward, args, prompt_dataset(), tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    assert trainer.plan.old_logps_train and trainer.plan.old_logps_eval
    batch = our_batch(fixed_samples(tokenizer, torch.Generator().manual_seed(1)), tokenizer.pad_token_id)
    trainer.rollout_logps(batch, "train")
    trainer.correct_sampling(batch)
    mask = batch.loss_mask.bool()
    w = torch.exp(batch.old_logps - batch.sampling_logps).clamp(max=3.0)
    expected = (-batch.advantages[:, None] * w)[mask].sum() / mask.sum()
    with torch.no_grad():
        loss = trainer.compute_policy_loss(trainer.model, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    logged = trainer._metrics["train"]
    assert not math.isnan(logged["sampling/importance_sampling_ratio/mean"][-1])
    assert logged["sampling/importance_sampling_ratio/staleness_0"][-1] == pytest.approx(w[mask].mean().item())


def test_async_grpo_trains_and_logs_trls_metrics(tokenizer, tmp_path, engines):
    args = async_args(tmp_path, max_steps=3, learning_rate=0.05)
    trainer = AsyncGRPOTrainer(build_causal_lm(tokenizer), varied_reward, args, prompt_dataset(), tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before), set(before) - set(changed)
    logged = set().union(*trainer.state.log_history)
    for name in ("sample/staleness_mean", "sample/staleness_max", "sample/dropped_stale_total",
                 "sample/rollout_queue_size", "perf/rollout_wait_s", "perf/weight_sync_s", "ratio", "kl", "entropy",
                 "clip_ratio/region_mean", "reward", "completions/mean_length"):  # fmt: skip
        assert name in logged, name
    assert trainer.model_version == 2 and trainer.epsilon_low == trainer.epsilon_high == 0.2
    assert not producer_threads()
