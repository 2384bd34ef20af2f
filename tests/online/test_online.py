"""The online core (`trl_unified/online/`): TRL's usage surface, the typed rollout batch, iterable data,
sync_ref_model, all-None rewards, and a new online algorithm written in a few lines."""

import logging
import math

import pytest
import torch
from datasets import IterableDataset
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedTokenizerFast

from tests.helpers import prompt_dataset, rloo_args, varied_reward
from trl_unified import OnlineConfig, OnlineTrainer, RLOOTrainer, RolloutBatch
from trl_unified.testing import build_causal_lm


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


# ------------------------------------------------------------------ the typed batch
def test_rollout_batch_select_split_and_model_inputs():
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[0, 5], [6, 7], [0, 8], [9, 9]]),
        prompt_mask=torch.tensor([[0, 1], [1, 1], [0, 1], [1, 1]]),
        completion_ids=torch.tensor([[1, 2, 0], [3, 0, 0], [4, 4, 4], [5, 6, 0]]),
        completion_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]),
        rewards=torch.tensor([0.0, 1.0, 2.0, 3.0]),
        row_index=torch.arange(4),
        is_truncated=torch.tensor([False, False, True, False]),
        old_logps=torch.arange(12.0).view(4, 3),
        visual_inputs=[{"pixel_values": torch.full((1, 2), float(i))} for i in range(4)],
        prompt_token_inputs={"mm_token_type_ids": torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0]])},
    )
    picked = batch.select(torch.tensor([2, 0]))
    assert picked.rewards.tolist() == [2.0, 0.0] and picked.row_index.tolist() == [2, 0]
    assert picked.old_logps.tolist() == [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]] and picked.ref_logps is None
    assert [row["pixel_values"][0, 0].item() for row in picked.visual_inputs] == [2.0, 0.0]
    assert picked.prompt_token_inputs["mm_token_type_ids"].tolist() == [[0, 0], [0, 1]]
    first, second = batch.split(2)
    assert first.rewards.tolist() == [0.0, 1.0] and second.completion_ids.tolist() == [[4, 4, 4], [5, 6, 0]]
    with pytest.raises(ValueError, match="Cannot split a batch of 4 rows into 3"):
        batch.split(3)
    ids, mask, extra = first.model_inputs()
    assert ids.tolist() == [[0, 5, 1, 2, 0], [6, 7, 3, 0, 0]] and mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert extra["pixel_values"].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert extra["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0], [1, 1, 0, 0, 0]]  # zeros over the completion
    shuffled = batch.shuffled()
    order = shuffled.row_index
    assert sorted(order.tolist()) == [0, 1, 2, 3] and torch.equal(shuffled.rewards, batch.rewards[order])
    # gather_global puts shuffled rows back in generation order (one process here; 2 processes: test_multiprocess)
    assert torch.equal(shuffled.gather_global(shuffled.rewards), batch.rewards)
    assert torch.equal(shuffled.gather_global(shuffled.old_logps), batch.old_logps)


# ------------------------------------------------------------------ TRL's attributes
def test_trl_attributes_ref_model_reward_funcs_and_processing_classes(llama_path, tokenizer, tmp_path):
    trainer = RLOOTrainer(
        llama_path,
        [varied_reward, varied_reward],
        args=rloo_args(tmp_path, beta=0.1),
        train_dataset=prompt_dataset(),
        reward_processing_classes=[tokenizer, None],
    )
    assert isinstance(trainer.ref_model, torch.nn.Module) and trainer.ref_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    assert trainer.reward_funcs == [varied_reward, varied_reward]
    assert trainer.reward_func_names == ["varied_reward", "varied_reward"]
    assert len(trainer.reward_processing_classes) == 2
    assert (trainer.num_generations, trainer.beta, trainer.num_iterations) == (2, 0.1, 1)
    no_ref = RLOOTrainer(llama_path, varied_reward, args=rloo_args(tmp_path, beta=0.0), train_dataset=prompt_dataset())
    assert no_ref.ref_model is None
    peft = RLOOTrainer(
        llama_path,
        varied_reward,
        args=rloo_args(tmp_path, beta=0.1),
        train_dataset=prompt_dataset(),
        peft_config=LoraConfig(**LORA),
    )
    assert peft.ref_model is None and peft.reference_model.kind == "adapter_disabled"


def test_logs_have_trl_structure(llama_path, tmp_path):
    def judged(completions, log_extra, **kwargs):
        log_extra("note", [len(c) for c in completions])
        return varied_reward(completions)

    args = rloo_args(tmp_path, max_steps=2, beta=0.0)
    trainer = RLOOTrainer(llama_path, judged, args=args, train_dataset=prompt_dataset())
    trainer.train()
    logs = trainer._logs
    assert set(logs) == {"images", "prompt", "completion", "rewards", "advantages", "extra"}
    size = trainer.args.generation_batch_size
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == size
    assert list(logs["rewards"]) == ["judged"] and len(logs["rewards"]["judged"]) == size
    assert list(logs["extra"]["note"]) == [len(c) for c in logs["completion"]]
    assert len(logs["images"]) == 0
    # leave-one-out advantages of each group of 2: (r1 - r2, r2 - r1)
    rewards, advantages = list(logs["rewards"]["judged"]), list(logs["advantages"])
    for i in range(0, size, 2):
        assert advantages[i] == pytest.approx(rewards[i] - rewards[i + 1], abs=1e-6)
        assert advantages[i + 1] == pytest.approx(-advantages[i], abs=1e-6)


def test_log_multimodal_false_keeps_images_out_of_the_logs(tmp_path):
    from datasets import Dataset

    from trl_unified.testing import build_image, build_vision_language_model

    model, processor = build_vision_language_model()
    rows = [{"prompt": [{"role": "user", "content": "which image ?"}], "image": build_image(i)} for i in range(4)]
    for log_multimodal, expected in ((False, 0), (True, 4)):
        args = rloo_args(tmp_path, max_steps=1, beta=0.0, log_multimodal=log_multimodal)
        trainer = RLOOTrainer(model, varied_reward, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=processor)  # fmt: skip
        trainer.train()
        assert len(trainer._logs["images"]) == expected
        assert len(trainer._logs["prompt"]) == 4


# ------------------------------------------------------------------ iterable datasets
def test_iterable_eval_repeats_each_prompt_num_generations_times(llama_path, tmp_path):
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append(list(prompts))
        return varied_reward(completions)

    train = prompt_dataset()
    evals = IterableDataset.from_generator(lambda: ({"prompt": p} for p in ["x y", "z", "w v u", "t"]))
    args = rloo_args(tmp_path, per_device_eval_batch_size=4, dataloader_num_workers=2)
    trainer = RLOOTrainer(llama_path, reward, args=args, train_dataset=train, eval_dataset={"stream": evals})
    assert trainer.args.dataloader_num_workers == 2  # an iterable eval set leaves the map-style train loader alone
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_stream_loss"])
    assert sum(len(b) for b in seen) == 8  # 4 prompts x G=2, nothing lost, nothing padded
    for batch in seen:
        assert all(batch[i] == batch[i + 1] for i in range(0, len(batch), 2)), batch  # groups of one prompt
    assert sorted({p for batch in seen for p in batch}) == ["t", "w v u", "x y", "z"]


def test_iterable_train_forces_one_worker_and_no_dispatch(llama_path, tmp_path, caplog):
    data = IterableDataset.from_generator(lambda: ({"prompt": p} for p in ["a b", "c", "d e f", "g"] * 8))
    args = rloo_args(tmp_path, dataloader_num_workers=2)
    with caplog.at_level(logging.WARNING):
        trainer = RLOOTrainer(llama_path, varied_reward, args=args, train_dataset=data)
    assert trainer.args.dataloader_num_workers == 0
    assert "Iterable datasets require `dataloader_num_workers=0`" in caplog.text
    assert trainer.args.accelerator_config.dispatch_batches is False
    args = rloo_args(tmp_path, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match=r"^Iterable datasets require `dispatch_batches=False`"):
        RLOOTrainer(llama_path, varied_reward, args=args, train_dataset=data)


# ------------------------------------------------------------------ reference model
def test_sync_ref_model_mixes_the_policy_into_the_reference(llama_path, tmp_path):
    args = rloo_args(tmp_path, beta=0.1, max_steps=2, sync_ref_model=True, ref_model_sync_steps=2,
                     ref_model_mixup_alpha=0.5)  # fmt: skip
    trainer = RLOOTrainer(llama_path, varied_reward, args=args, train_dataset=prompt_dataset())
    ref_before = {n: p.clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    policy = dict(trainer.model.named_parameters())
    for name, ref in trainer.ref_model.named_parameters():
        expected = 0.5 * policy[name].detach() + 0.5 * ref_before[name]
        torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(ref, ref_before[n]) for n, ref in trainer.ref_model.named_parameters())
    with pytest.raises(NotImplementedError, match="sync_ref_model=True` while using a PEFT model"):
        RLOOTrainer(llama_path, varied_reward, args=rloo_args(tmp_path, beta=0.1, sync_ref_model=True),
                    train_dataset=prompt_dataset(), peft_config=LoraConfig(**LORA))  # fmt: skip


def test_ref_adapter_only_for_a_model_that_arrives_with_an_adapter(tokenizer, tmp_path):
    """TRL 1.16's rule: a PeftModel passed in gets a frozen "ref" copy of its adapter; an adapter the trainer creates
    from peft_config (e.g. targeting a MoE's expert parameters) is zero-initialised, so the base model is the ref."""
    args = rloo_args(tmp_path, beta=0.1)
    fresh = RLOOTrainer(build_causal_lm(tokenizer, "llama"), varied_reward, args=args, processing_class=tokenizer,
                        train_dataset=prompt_dataset(), peft_config=LoraConfig(**LORA))  # fmt: skip
    assert fresh.reference_model.kind == "adapter_disabled" and "ref" not in fresh.model.peft_config
    arrived = get_peft_model(build_causal_lm(tokenizer, "llama"), LoraConfig(**LORA))
    trainer = RLOOTrainer(
        arrived, varied_reward, args=args, processing_class=tokenizer, train_dataset=prompt_dataset()
    )
    assert trainer.reference_model.kind == "ref_adapter" and "ref" in trainer.model.peft_config


# ------------------------------------------------------------------ rewards
def test_all_none_rewards_warn_and_train_on_zero_advantages(llama_path, tmp_path, caplog):
    def abstain(completions, **kwargs):
        return [None] * len(completions)

    trainer = RLOOTrainer(llama_path, abstain, args=rloo_args(tmp_path, beta=0.0), train_dataset=prompt_dataset())
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "All reward functions returned None for the following kwargs" in caplog.text
    assert all(a == 0.0 for a in trainer._logs["advantages"])
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(loss == 0.0 for loss in losses)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name  # zero advantages: zero gradient, weight decay 0
    strict = RLOOTrainer(llama_path, abstain, args=rloo_args(tmp_path, strict_rewards=True),
                         train_dataset=prompt_dataset())  # fmt: skip
    with pytest.raises(ValueError, match="Every reward function returned None/NaN .* strict_rewards=True"):
        strict.train()


# ------------------------------------------------------------------ a new online algorithm in a few lines
class ReinforceTrainer(OnlineTrainer):
    """REINFORCE with a batch-mean baseline: A_i = r_i - mean_j r_j; L = -1/B sum_i A_i log pi(y_i)."""

    _name = "REINFORCE"

    def compute_advantages(self, rewards, rewards_per_func, batch, mode):
        return torch.nan_to_num(rewards - torch.nanmean(rewards))

    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        input_ids, attention_mask, extra = inputs.model_inputs()
        mask = inputs.completion_mask
        logps = self.token_logprobs(model, input_ids, attention_mask, mask.size(1), **extra).logps
        return -(inputs.advantages * (logps * mask).sum(1)).mean()


def test_a_minimal_online_trainer_trains(qwen2_path, tmp_path):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path)
    args = OnlineConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_steps=40,
                        max_completion_length=8, learning_rate=3e-2, logging_steps=5, report_to=[], bf16=False,
                        save_strategy="no", gradient_checkpointing=False, seed=0)  # fmt: skip

    def count_a(completions, **kwargs):
        return [c.split().count("a") / max(1, len(c.split())) for c in completions]

    trainer = ReinforceTrainer(qwen2_path, count_a, args=args, train_dataset=prompt_dataset(64),
                               processing_class=tokenizer)  # fmt: skip
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    assert rewards[-1] > rewards[0] + 0.1, rewards
