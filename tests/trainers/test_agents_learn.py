"""A tiny policy learns to use a tool: only a completion that calls `lookup` before answering earns a reward.

The environment hides a secret word that changes every episode; the reward is paid when the model looked it up (a
real tool call, parsed from its completion, executed by the trainer's tool loop) and then answered with a word. The
policy is a 2-layer model first taught the chat format on random conversations where 1 in 10 calls the tool, so
that calling is rare but not unheard of; GRPO with `environment_factory` must then raise the call rate and the reward.
(Using the looked-up value, which this 2-layer model does not learn in a few hundred steps, is what
`examples/tools.py` shows on a real model.)
"""

import random

import pytest
import torch
from datasets import Dataset

from trl_unified import GRPOConfig, GRPOTrainer
from trl_unified.testing import build_causal_lm, build_tool_tokenizer


WORDS = ["red", "green", "blue"]
PROMPT = [{"role": "user", "content": "secret word ?"}]


class Vault:
    rng = random.Random(0)

    def reset(self, **row):
        self.secret, self.calls = self.rng.choice(WORDS), 0

    def lookup(self) -> str:
        """Look up today's secret word."""
        self.calls += 1
        return self.secret


def looked_up_then_answered(completions, environments, **kwargs):
    rewards = []
    for completion, env in zip(completions, environments, strict=True):
        words = (completion[-1].get("content") or "").split()
        rewards.append(float(env.calls >= 1 and words[:1] in [[w] for w in WORDS]))
    return rewards


def format_warm_up(model, tokenizer, steps=400, call_rate=0.1, seed=1):
    """Next-token training on conversations with random answers (a tool call in `call_rate` of them)."""
    rng, call = random.Random(seed), {"type": "function", "function": {"name": "lookup", "arguments": {}}}
    render = dict(tools=[Vault.lookup], tokenize=True, return_dict=False)
    prompt_length = len(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, **render))
    conversations = []
    for _ in range(64):
        turns = [{"role": "assistant", "content": "", "tool_calls": [call]}]
        turns.append({"role": "tool", "name": "lookup", "content": rng.choice(WORDS)})
        answer = [{"role": "assistant", "content": rng.choice(WORDS)}]
        conversations.append(PROMPT + (turns if rng.random() < call_rate else []) + answer)
    sequences = [tokenizer.apply_chat_template(c, **render) for c in conversations]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = rng.sample(sequences, 8)
        width = max(map(len, batch))
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in batch])
        labels = ids.clone()
        labels[:, :prompt_length] = -100
        for i, s in enumerate(batch):
            labels[i, len(s) :] = -100
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.slow  # ~2 minutes; the tool loop is covered by tests/online/test_agents.py and the TRL equivalence
def test_grpo_with_an_environment_learns_to_call_the_tool(tmp_path):
    torch.manual_seed(0)
    tokenizer = build_tool_tokenizer(corpus=["secret word ? red green blue"] * 4)
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=32, seed=0)
    format_warm_up(model, tokenizer)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=48,
        learning_rate=3e-3,
        max_steps=120,
        logging_steps=10,
        beta=0.0,
        max_tool_calling_iterations=1,
        report_to=[],
        save_strategy="no",
        bf16=False,
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model,
        looked_up_then_answered,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 64}),
        processing_class=tokenizer,
        environment_factory=Vault,
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    rewards = [log["reward"] for log in logs]
    calls = [log["tools/call_frequency"] for log in logs]
    assert rewards[0] < 0.3 and calls[0] < 0.3, (rewards, calls)  # calling is rare after the warm-up
    assert min(rewards[-2:]) > 0.7 and min(calls[-2:]) > 0.8, (rewards, calls)  # measured: 0.87-0.94, 0.93-0.97
