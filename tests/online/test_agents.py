"""Agents in the online core (online/agents.py): tools, the multi-turn tool loop, rollout functions and environments.

Generation is scripted where the test needs given completions (a patched `model.generate`, as TRL's own tests do): the
tiny model is random, the code under test is everything around it.
"""

import asyncio

import pytest
import torch
from datasets import Dataset

from tests.helpers import tiny_run_args
from trl_unified import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl_unified.online.agents import EventLoopThread, run_tool_calls, tool_suffix_ids
from trl_unified.testing import build_causal_lm, build_tool_tokenizer


CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'
MULTIPLY_CALL = CALL.format(name="multiply", args='{"a": 3, "b": 4}')
# What TRL's qwen2_5 template renders after a model turn that called a tool returning 12, up to the next turn.
SUFFIX_12 = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


async def async_multiply(a: int, b: int) -> int:
    """Multiplies two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a * b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the service is down")


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_tool_tokenizer()


def script(tokenizer, turns):
    """A `generate` replacement returning, at call k, the texts `turns[k]` (one per row) after the input ids."""
    calls = []

    def generate(input_ids, **kwargs):
        texts = turns[len(calls)]
        calls.append(input_ids.shape[0])
        assert len(texts) == input_ids.shape[0], (len(texts), input_ids.shape)
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, ids))
        ids = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids]
        return torch.cat([input_ids, torch.tensor(ids, device=input_ids.device)], 1)

    return generate, calls


def conversations(n=4, text="What is 3 times 4?"):
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": text}]] * n})


def agent_args(tmp_path, config=GRPOConfig, **overrides):
    defaults = dict(
        per_device_train_batch_size=3, num_generations=3, max_completion_length=128, max_steps=1, learning_rate=0.1
    )
    return tiny_run_args(config, tmp_path / "agent", **{**defaults, **overrides})


def record_rewards(seen):
    def reward(prompts, completions, **kwargs):
        seen.append((prompts, completions, kwargs))
        return [float(len(c)) for c in completions]

    return reward


# ------------------------------------------------------------------ executing tool calls
def test_tool_calls_run_and_every_failure_becomes_a_message():
    calls = [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}},
        {"type": "function", "function": {"name": "async_multiply", "arguments": {"a": 2, "b": 5}}},
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "c": 4}}},
        {"type": "function", "function": {"name": "decrement", "arguments": {}}},
        {"type": "function", "function": {"name": "broken", "arguments": {"x": 1}}},
        {"type": "code", "name": "shell"},
    ]
    results, failures = run_tool_calls(calls, [multiply, async_multiply, broken], EventLoopThread())
    assert failures == 4
    # sync results (and errors) in call order, then the async ones: TRL's order
    assert results == [
        ("multiply", 12),
        ("multiply", {"error": "multiply() got an unexpected keyword argument 'c'"}),
        ("decrement", {"error": "Tool decrement not found."}),
        ("broken", {"error": "the service is down"}),
        ("shell", {"error": "Unsupported tool call type: code"}),
        ("async_multiply", 10),
    ]


def test_tool_suffix_is_the_templates_tool_turn_and_next_prompt(tool_tokenizer):
    ids = tool_suffix_ids(tool_tokenizer, [{"role": "tool", "name": "multiply", "content": "12"}], None, {})
    assert tool_tokenizer.decode(ids) == SUFFIX_12


# ------------------------------------------------------------------ the multi-turn rollout
def test_tool_loop_appends_results_masks_tool_tokens_and_rewards_see_the_conversation(tool_tokenizer, tmp_path):
    seen = []
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards(seen),
        args=agent_args(tmp_path, loss_type="bnpo"),
        train_dataset=conversations(),
        processing_class=tool_tokenizer,
        tools=[multiply],
    )
    bad_args = CALL.format(name="multiply", args='{"a": 3, "c": 4}')
    turns = [[MULTIPLY_CALL, bad_args, "I do not know<|im_end|><|endoftext|>"], ["Done!<|im_end|>"] * 2]
    trainer.model.generate, calls = script(tool_tokenizer, turns)
    batch = trainer._prepare_inputs([dict(row) for row in [trainer.train_dataset[0]] * 3])
    assert calls == [3, 2]  # the continuation is generated for the two rows that called a tool
    rows = batch.select(torch.argsort(batch.row_index))  # the buffer shuffles rows
    first = tool_tokenizer(MULTIPLY_CALL, add_special_tokens=False)["input_ids"]
    suffix = tool_tokenizer(SUFFIX_12, add_special_tokens=False)["input_ids"]
    done = tool_tokenizer("Done!<|im_end|>", add_special_tokens=False)["input_ids"]
    length = len(first) + len(suffix) + len(done)
    assert rows.completion_ids[0, :length].tolist() == first + suffix + done  # the sampled ids, never re-tokenised
    assert rows.tool_mask[0, :length].tolist() == [1] * len(first) + [0] * len(suffix) + [1] * len(done)
    assert rows.loss_mask[0].tolist() == rows.tool_mask[0, :length].tolist() + [0] * (rows.loss_mask.size(1) - length)
    assert rows.loss_mask[2].sum() == len(
        tool_tokenizer("I do not know<|im_end|>", add_special_tokens=False)["input_ids"]
    )
    # rewards see the whole conversation: the call, the tool's answer (or its error), the final turn
    completions = seen[0][1]
    assert completions[0][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert completions[0][2] == {"role": "assistant", "content": "Done!"}
    assert completions[1][1]["content"] == "{'error': \"multiply() got an unexpected keyword argument 'c'\"}"
    assert completions[2] == [{"role": "assistant", "content": "I do not know"}]
    # bnpo's loss, ratio 1: -sum_i A_i * (model tokens of i) / (model tokens of the batch): tool tokens do not count
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train(); the loss is computed here directly
    loss = trainer.compute_policy_loss(trainer.model, rows)
    tokens = rows.loss_mask.sum(1).float()
    torch.testing.assert_close(loss, -(rows.advantages * tokens).sum() / tokens.sum(), rtol=1e-5, atol=1e-6)


def test_tool_metrics_and_training(tool_tokenizer, tmp_path):
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards([]),
        args=agent_args(tmp_path),
        train_dataset=conversations(),
        processing_class=tool_tokenizer,
        tools=[async_multiply],
    )
    first = [CALL.format(name="async_multiply", args='{"a": 3, "b": 4}'), CALL.format(name="nope", args="{}")]
    trainer.model.generate, calls = script(tool_tokenizer, [[*first, "Hi<|im_end|>"], ["Done!<|im_end|>"] * 2])
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == pytest.approx(2 / 3) and log["tools/failure_frequency"] == pytest.approx(0.5)
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())


def test_max_tool_calling_iterations_stops_the_loop(tool_tokenizer, tmp_path):
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards([]),
        args=agent_args(tmp_path, max_tool_calling_iterations=1),
        train_dataset=conversations(),
        processing_class=tool_tokenizer,
        tools=[multiply],
    )
    trainer.model.generate, calls = script(tool_tokenizer, [[MULTIPLY_CALL] * 3, [MULTIPLY_CALL] * 3])
    sampled = trainer._generate([[{"role": "user", "content": "3 times 4?"}]] * 3)
    assert calls == [3, 3] and sampled.tool_calls == 3  # one round ran; the second round's calls are not executed
    assert all(c[-1]["tool_calls"] for c in sampled.completions)


def test_plain_prompts_with_tools_are_rejected(tool_tokenizer, tmp_path):
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards([]),
        args=agent_args(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": ["3 times 4?"] * 4}),
        processing_class=tool_tokenizer,
        tools=[multiply],
    )
    with pytest.raises(ValueError, match="Tools need conversational prompts"):
        trainer._generate(["3 times 4?"])


def test_rloo_trains_with_tools(tool_tokenizer, tmp_path):
    trainer = RLOOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards([]),
        args=agent_args(tmp_path, config=RLOOConfig, beta=0.1),
        train_dataset=conversations(),
        processing_class=tool_tokenizer,
        tools=[multiply],
    )
    trainer.model.generate, calls = script(
        tool_tokenizer, [[MULTIPLY_CALL, "A<|im_end|>", "B<|im_end|>"], ["12<|im_end|>"]]
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert calls == [3, 1] and trainer.state.log_history[0]["tools/call_frequency"] == pytest.approx(1 / 3)
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())


# ------------------------------------------------------------------ rollout functions
def test_rollout_func_replaces_generation_and_forwards_extra_fields(tool_tokenizer, tmp_path):
    seen, received = [], []

    def rollout_func(prompts, trainer):
        received.append((prompts, trainer))
        return {
            "prompt_ids": [[5, 6, 7]] * len(prompts),
            "completion_ids": [[8, 9, 2], [10, 2], [11, 12, 13]],
            "logprobs": [[-0.1] * 3, [-0.2] * 2, [-0.3] * 3],
            "env_mask": [[1, 0, 1], [1, 1], [1, 1, 1]],
            "judge_score": [0.1, 0.2, 0.3],
            "episode": "e7",
        }

    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards(seen),
        args=agent_args(tmp_path),
        train_dataset=conversations(),
        processing_class=tool_tokenizer,
        rollout_func=rollout_func,
    )
    batch = trainer._prepare_inputs([dict(trainer.train_dataset[0]) for _ in range(3)])
    rows = batch.select(torch.argsort(batch.row_index))
    assert received[0][1] is trainer and len(received[0][0]) == 3
    assert rows.completion_ids.tolist() == [[8, 9, 2], [10, 2, 0], [11, 12, 13]]
    assert rows.loss_mask.tolist() == [[1, 0, 1], [1, 1, 0], [1, 1, 1]]  # env_mask: the environment's tokens
    assert rows.is_truncated.tolist() == [False, False, True]  # the last row does not end with EOS
    kwargs = seen[0][2]
    assert kwargs["judge_score"] == [0.1, 0.2, 0.3] and kwargs["episode"] == ["e7"] * 3


def test_rollout_func_missing_keys_raise(tool_tokenizer, tmp_path):
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards([]),
        args=agent_args(tmp_path),
        train_dataset=conversations(),
        processing_class=tool_tokenizer,
        rollout_func=lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]},
    )
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer._generate(["prompt"])


# ------------------------------------------------------------------ environments
class Counter:
    def __init__(self):
        self.count, self.resets = 0, []

    def reset(self, **kwargs):
        self.count = 0
        self.resets.append(kwargs)
        return " Count up."

    def increment(self, step: int) -> int:
        """Adds step to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


class Echo:
    def reset(self, **kwargs):
        return None

    def shout(self, text: str) -> str:
        """Shouts the text.

        Args:
            text: What to shout.
        """
        return text.upper()


def test_environment_owns_data_tools_and_reward(tool_tokenizer, tmp_path):
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        args=agent_args(tmp_path, max_steps=2),
        processing_class=tool_tokenizer,
        environment_factory=Counter,
    )
    assert trainer.reward_func_names == ["Counter"] and trainer.reward_weights.tolist() == [1.0]
    assert [t.__name__ for t in trainer.tools] == ["increment"]
    assert len(trainer._environment_pool[None]) == 1  # the probe instance
    increment = CALL.format(name="increment", args='{"step": 2}')
    turn = [[increment, "Hi<|im_end|>", "Hi<|im_end|>"], ["Done!<|im_end|>"]]
    trainer.model.generate, calls = script(tool_tokenizer, turn + turn)
    trainer.train()
    assert [e.count for e in trainer.environments] == [2, 0, 0]  # one instance per rollout, each reset per batch
    assert len(trainer._environment_pool[None]) == 3
    assert trainer.environments[0].resets[-1] == {"prompt": [{"role": "user", "content": ""}]}
    assert trainer.state.log_history[-2]["rewards/Counter/mean"] == pytest.approx(2 / 3)
    assert trainer._logs["prompt"][0] == [{"role": "user", "content": " Count up."}]  # reset's observation


def test_environments_by_name_route_rows_and_own_rewards(tool_tokenizer, tmp_path):
    seen = []
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 4})
    trainer = GRPOTrainer(
        build_causal_lm(tool_tokenizer, "qwen2"),
        record_rewards(seen),
        args=agent_args(tmp_path, per_device_train_batch_size=4, num_generations=2, shuffle_dataset=False),
        train_dataset=dataset,
        processing_class=tool_tokenizer,
        environment_factory={"counter": Counter, "echo": Echo},
    )
    assert [t.__name__ for t in trainer._env_tools["counter"]] == ["increment"]
    assert [t.__name__ for t in trainer._env_tools["echo"]] == ["shout"]
    assert trainer.reward_func_names == ["reward", "Counter"] and trainer.reward_weights.tolist() == [1.0, 1.0]
    shout = CALL.format(name="shout", args='{"text": "hi"}')
    increment = CALL.format(name="increment", args='{"step": 1}')
    trainer.model.generate, calls = script(
        tool_tokenizer, [[increment, "Hi<|im_end|>", shout, "Hi<|im_end|>"], ["Done!<|im_end|>"] * 2]
    )
    trainer.train()
    assert calls == [4, 2]
    assert [type(e).__name__ for e in trainer.environments] == ["Counter", "Counter", "Echo", "Echo"]
    assert all("environment" not in kwargs for kwargs in trainer.environments[0].resets)
    assert seen[0][1][2][1] == {"role": "tool", "name": "shout", "content": "HI"}
    assert seen[0][2]["environments"] == trainer.environments  # every reward function gets the environments
    assert trainer.reward_funcs[-1](environments=[Counter(), Echo()]) == [0.0, None]


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            dict(environment_factory={"counter": Counter}, data={"environment": ["other"] * 4}),
            "not among the environments",
        ),
        (dict(environment_factory=Counter, data=None, max_steps=-1), "`max_steps` must be set"),
        (dict(environment_factory={"a": Counter, "b": Echo}, data=None), "requires a `train_dataset`"),
        (dict(data=None), "`train_dataset` is required unless an `environment_factory`"),
        (dict(environment_factory=lambda: object(), data=None), "must define a callable `reset`"),
    ],
)
def test_environment_input_errors(kwargs, pattern, tool_tokenizer, tmp_path):
    """Each raises before anything is generated: at construction, or (an unknown `environment` value, as TRL's
    own test expects) when train() starts."""
    data = kwargs.pop("data")
    config = {"max_steps": kwargs.pop("max_steps", 1)}
    with pytest.raises(ValueError, match=pattern):
        trainer = GRPOTrainer(
            build_causal_lm(tool_tokenizer, "qwen2"),
            record_rewards([]),
            args=agent_args(tmp_path, **config),
            train_dataset=Dataset.from_dict(data) if data else None,
            processing_class=tool_tokenizer,
            **kwargs,
        )
        trainer.model.generate = None  # nothing may be generated before the error
        trainer.train()
