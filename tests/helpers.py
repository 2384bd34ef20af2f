"""Small builders shared by the tests."""

from datasets import Dataset

from trl_unified import GRPOConfig, RLOOConfig


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
