"""The policy actually learns: reward rises on a toy task (a sign error or a detached loss shows up here)."""

import time
from statistics import mean

from tests.helpers import count_a, prompt_dataset, rloo_args
from trl_unified import RLOOTrainer
from trl_unified.testing import build_causal_lm


def test_rloo_learns_toy_reward(tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=32, seed=0)
    args = rloo_args(
        tmp_path,
        max_steps=80,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-2,
        beta=0.0,
        seed=0,
    )
    trainer = RLOOTrainer(model, count_a, args=args, train_dataset=prompt_dataset(64), processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    print(
        f"reward first10={mean(rewards[:10]):.3f} last10={mean(rewards[-10:]):.3f} "
        f"in {time.perf_counter() - start:.1f}s"
    )
    assert mean(rewards[-10:]) > mean(rewards[:10]) + 0.3, rewards
