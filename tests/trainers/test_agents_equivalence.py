"""Drop-in proof for agents: with generation scripted (a tool call, a call with a bad argument, plain text; then the
continuations), trl_unified's GRPOTrainer with `tools` gives trl.GRPOTrainer's losses, per-step gradients,
parameters and metrics (tool call and failure frequencies, lengths over the model's own tokens)."""

import pytest
import torch
import trl
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback

import trl_unified
from trl_unified.testing import build_causal_lm, build_tool_tokenizer, save_tiny_model


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


CALLS = [
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "c": 4}}\n</tool_call><|im_end|>',
    "I do not know<|im_end|><|endoftext|>",
    '<tool_call>\n{"name": "divide", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
]


def scripted_generate(tokenizer):
    """First turns by the row's prompt and its occurrence in the call; a row that already has a tool response
    continues with a short answer. Depends on nothing but the input ids, so both trainers get the same tokens."""
    response = tokenizer.convert_tokens_to_ids("<tool_response>")

    def generate(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
        seen, rows = {}, []
        for prompt, mask in zip(input_ids, attention_mask):
            ids = prompt[mask.bool()].tolist()
            if response in ids:
                text = f"It is {len(ids) % 7}.<|im_end|>"
            else:
                k = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
                text = CALLS[(sum(ids) + k) % len(CALLS)]
            rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        width = max(map(len, rows))
        pad = tokenizer.pad_token_id
        rows = [r + [pad] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)

    return generate


def reward(completions, **kwargs):
    """Turns of the conversation plus the length of its last message."""
    return [len(c) + len(c[-1]["content"]) / 20 for c in completions]


class GradRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


@pytest.fixture(scope="module")
def tool_model_path(tmp_path_factory):
    tokenizer = build_tool_tokenizer()
    return save_tiny_model(build_causal_lm(tokenizer, "qwen2"), tokenizer, str(tmp_path_factory.mktemp("tools")))


def run(module, path, tmp_path, **overrides):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    kwargs = dict(
        output_dir=str(tmp_path / module.__name__), per_device_train_batch_size=6, num_generations=3,
        max_completion_length=96, max_steps=3, learning_rate=1e-3, logging_steps=1, bf16=False, report_to=[],
        save_strategy="no", gradient_checkpointing=False, seed=7, beta=0.05,
    )  # fmt: skip
    kwargs.update(overrides)
    questions = ["What is 3 times 4?", "Multiply 2 and 4.", "Hello there.", "Compute 6 times 7."]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})
    recorder = GradRecorder()
    trainer = module.GRPOTrainer(
        path, reward_funcs=reward, args=module.GRPOConfig(**kwargs), train_dataset=dataset,
        processing_class=tokenizer, callbacks=[recorder], tools=[multiply],
    )  # fmt: skip
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return recorder.grads, params, trainer.state.log_history


@pytest.mark.parametrize("overrides", [{}, {"loss_type": "grpo", "num_iterations": 2}], ids=["dapo", "grpo_mu2"])
def test_tool_calling_grpo_matches_trl(overrides, tool_model_path, tmp_path, monkeypatch):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tool_model_path)
    monkeypatch.setattr(Qwen2ForCausalLM, "generate", scripted_generate(tokenizer))
    theirs = run(trl, tool_model_path, tmp_path, **overrides)
    ours = run(trl_unified, tool_model_path, tmp_path, **overrides)
    assert len(ours[0]) == len(theirs[0]) == 3
    for step, (g, ref) in enumerate(zip(ours[0], theirs[0])):
        assert g.keys() == ref.keys()
        for name in g:
            torch.testing.assert_close(g[name], ref[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
    for name, value in ours[1].items():
        torch.testing.assert_close(value, theirs[1][name], rtol=1e-4, atol=1e-5, msg=name)
    keys = ["loss", "reward", "kl", "entropy", "tools/call_frequency", "tools/failure_frequency", "num_tokens"]
    keys += ["completions/mean_length", "completions/max_length", "completions/clipped_ratio"]
    for key in keys:
        mine = [log[key] for log in ours[2] if key in log and "train_loss" not in log]
        ref = [log[key] for log in theirs[2] if key in log and "train_loss" not in log]
        assert len(mine) == len(ref) > 0, key  # rollout metrics: once per generation round
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(ref), rtol=1e-4, atol=1e-5, msg=key)
    assert any(log["tools/call_frequency"] > 0 and log["tools/failure_frequency"] > 0 for log in ours[2][:3])
