"""Small builders shared by the tests."""

import copy
import time

from datasets import Dataset

from trl_unified import GRPOConfig, RLOOConfig
from trl_unified.generation import generate_batched
from trl_unified.generation.vllm_engine import VLLMEngine


PROMPTS = ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"]


def prompt_dataset(n: int = 16, **columns) -> Dataset:
    data = {"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]}
    data.update({k: [v[i % len(v)] for i in range(n)] for k, v in columns.items()})
    return Dataset.from_dict(data)


def count_a(completions, **kwargs):
    """Fraction of the completion's words that are 'a'."""
    return [c.split().count("a") / max(1, len(c.split())) for c in completions]


UNSET = object()  # an override of UNSET drops a default (the config's own default applies)


def tiny_run_args(config_cls, output_dir, **overrides):
    """The tiny training run every test builds: `config_cls(output_dir=str(output_dir), <defaults below>)` with
    `overrides` on top (a builder passes what differs; UNSET removes a field)."""
    kwargs = dict(
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
    )
    kwargs.update(overrides)
    return config_cls(output_dir=str(output_dir), **{k: v for k, v in kwargs.items() if v is not UNSET})


def rloo_args(tmp_path, **overrides) -> RLOOConfig:
    defaults = dict(num_generations=2, max_completion_length=6)
    return tiny_run_args(RLOOConfig, tmp_path / "out", **{**defaults, **overrides})


def grpo_args(tmp_path, **overrides) -> GRPOConfig:
    defaults = dict(num_generations=2, max_completion_length=6)
    return tiny_run_args(GRPOConfig, tmp_path / "grpo", **{**defaults, **overrides})


def varied_reward(completions, **kwargs):
    """A reward with spread on random completions (so advantages are non-zero from the first step)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ord(w[0]) % 7 for w in t.split()) / (7 * max(1, len(t.split()))) for t in texts]


class SnapshotEngine(VLLMEngine):
    """vLLM's place in server mode: the weights copied at each sync sample (the lean decode loop), after `delay`
    seconds; `fail_at`: the request (1-based) that raises."""

    mode = "server"

    def __init__(self, args, tokenizer, delay=0.0, fail_at=None):
        super().__init__(args)
        self.tokenizer, self.delay, self.fail_at, self.requests, self.model = tokenizer, delay, fail_at, 0, None

    def sync_weights(self, model, accelerator):
        self.model = copy.deepcopy(accelerator.unwrap_model(model)).eval()

    def generate(self, prompt_ids, generation_config, eos_token_ids):
        with self.lock:
            self.requests += 1
            if self.requests == self.fail_at:
                raise ConnectionError("the stand-in server went away")
            time.sleep(self.delay)
            out = generate_batched(self.model, self.tokenizer, prompt_ids, generation_config,
                                   eos_token_ids=eos_token_ids, return_logprobs=True)  # fmt: skip
        rows = list(zip(out.completion_ids, out.logprobs, out.completion_mask))
        return [ids[m.bool()] for ids, _, m in rows], [lp[m.bool()] for _, lp, m in rows]
