"""The ratio's clipping bounds: `epsilon_high=0.0` is a value, not "unset" (TRL's rule, issue 28 item 2)."""

import pytest
import torch

from tests.helpers import prompt_dataset
from trl_unified import GRPOConfig, RLOOConfig, RLOOTrainer, RolloutBatch


@pytest.mark.parametrize("config_cls", [RLOOConfig, GRPOConfig])
def test_epsilon_high_zero_clips_at_one(config_cls, tmp_path):
    args = config_cls(output_dir=str(tmp_path), epsilon=0.2, epsilon_high=0.0, report_to="none")
    assert args.clip_range() == pytest.approx((0.8, 1.0))
    assert config_cls(output_dir=str(tmp_path), epsilon=0.2).clip_range() == pytest.approx((0.8, 1.2))
    assert config_cls(output_dir=str(tmp_path), epsilon=0.2, epsilon_high=0.28).clip_range() == pytest.approx(
        (0.8, 1.28)
    )


def test_rloo_loss_uses_an_upper_bound_of_one(llama_path, tmp_path):
    """A sequence whose ratio is e^0.1 > 1 with a positive advantage: the clipped objective is min(r A, 1.0 A) = A,
    so the loss is -A exactly (with the old bug, the bound was 1.2 and the loss -e^0.1 A)."""
    args = RLOOConfig(
        output_dir=str(tmp_path), epsilon_high=0.0, num_generations=2, per_device_train_batch_size=2,
        max_completion_length=4, report_to="none", num_iterations=2,
    )  # fmt: skip
    trainer = RLOOTrainer(llama_path, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=prompt_dataset(4))  # fmt: skip
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]])
    batch = RolloutBatch(
        prompt_ids=ids[:, :2], prompt_mask=torch.ones(2, 2, dtype=torch.long), completion_ids=ids[:, 2:],
        completion_mask=torch.ones(2, 2, dtype=torch.long), rewards=torch.zeros(2), row_index=torch.arange(2),
        is_truncated=torch.zeros(2, dtype=torch.bool), advantages=torch.tensor([1.5, 0.5]),
    )  # fmt: skip
    trainer.model.train()
    with torch.no_grad():
        logps = trainer.policy_logprobs(trainer.model, batch).logps
    batch.old_logps = logps - 0.05  # per token: the sequence ratio is exp(2 * 0.05) = e^0.1
    loss = trainer.compute_policy_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(-(1.5 + 0.5) / 2, abs=1e-5)
