"""GRMReward: a generative judge as a reward function, end to end inside an RLOO run."""

import pytest
from datasets import Dataset

from tests.helpers import prompt_dataset, rloo_args
from trl_unified import GRMConfig, GRMReward, GRMTrainer, RLOOTrainer
from trl_unified.testing import build_causal_lm, save_tiny_model


@pytest.fixture(scope="module")
def judge_path(tokenizer, tmp_path_factory):
    """A tiny GRM trained to always judge '<answer> 8 </answer>' (as a chat, like GRMReward asks it)."""
    out = tmp_path_factory.mktemp("judge")
    words = "a b c d e f g h i j k l".split()
    rows = [
        {
            "prompt": [
                {
                    "role": "user",
                    "content": f"Rate the response question : {words[i % 12]} response : "
                    f"{words[(i * 5) % 12]} {words[(i * 7) % 12]}",
                }
            ],
            "completion": [{"role": "assistant", "content": "<answer> 8 </answer>"}],
        }
        for i in range(64)
    ]
    args = GRMConfig(
        output_dir=str(out / "run"),
        per_device_train_batch_size=16,
        max_steps=40,
        learning_rate=3e-3,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
    )
    trainer = GRMTrainer(
        build_causal_lm(tokenizer, "llama", hidden_size=64),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    return save_tiny_model(trainer.model, tokenizer, str(out / "judge"))


@pytest.mark.parametrize(
    "mode, answer, expected",
    [
        ("score", "8", 7 / 9),
        ("score", "1", 0.0),
        ("score", "10", 1.0),
        ("score", "11", None),
        ("score", "eight", None),
        ("score", None, None),
        ("pairwise", "a", 1.0),
        ("pairwise", "response b", 0.0),
        ("pairwise", "tie", 0.5),
        ("pairwise", "c", None),
    ],
)
def test_answer_to_reward_mapping(mode, answer, expected, judge_path):
    assert GRMReward(judge_path, mode=mode).to_reward(answer) == expected


def test_grm_reward_scores_completions(judge_path):
    judge = GRMReward(judge_path, batch_size=2, max_new_tokens=8)
    rewards = judge(prompts=["a b", "c", "d e f"], completions=["g h", "i", "j k l"])
    assert rewards == [7 / 9] * 3
    assert all("<answer> 8 </answer>" in j for j in judge.last_judgments)


def test_grm_reward_inside_rloo(judge_path, llama_path, tmp_path):
    judge = GRMReward(judge_path, max_new_tokens=8)
    trainer = RLOOTrainer(llama_path, [judge], args=rloo_args(tmp_path, max_steps=2), train_dataset=prompt_dataset())
    trainer.train()
    logged = [log["rewards/grm_judge/mean"] for log in trainer.state.log_history if "rewards/grm_judge/mean" in log]
    assert logged == pytest.approx([7 / 9] * 2)


def test_pairwise_needs_the_reference_column(judge_path):
    with pytest.raises(ValueError, match="'reference'"):
        GRMReward(judge_path, mode="pairwise")(prompts=["a"], completions=["b"])
