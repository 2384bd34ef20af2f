"""Every trainer's default configuration takes the fast paths, asserted by what runs rather than by timings: a tiny
Qwen2 trains one step and no fallback is reported (`generation/fallbacks.py` logs one line per reason generation or a
forward takes its plain path: the lean decode loop, prompt sharing, the chunked LM head, padding-free passes); an
online trainer's generation runs the lean loop, and where a group repeats its prompt (G > 1) on a shared-prefix cache.
A default that leaves a fast path fails here."""

import logging
import os

import pytest
from datasets import Dataset

import trl_unified
from tests.helpers import tiny_run_args
from trl_unified.generation import batched, fallbacks, lean
from trl_unified.testing import build_causal_lm


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
PROMPTS = ["a b c", "d e", "f g h i", "j k"]


def says_a(completions, **kwargs):
    return [float("a" in str(c).split()) for c in completions]


def online(name, tokenizer, tmp_path, **sizes):
    """`<name>Trainer` with its defaults but for the run's sizes (4 rows, 1 step, short completions)."""
    Config, Trainer = getattr(trl_unified, f"{name}Config"), getattr(trl_unified, f"{name}Trainer")
    dataset = Dataset.from_dict({"prompt": PROMPTS, "privileged_context": ["a"] * 4})
    args = tiny_run_args(Config, tmp_path, max_steps=1, max_completion_length=4, **sizes)
    model = build_causal_lm(tokenizer)
    if name in ("Distillation",):
        return Trainer(model, build_causal_lm(tokenizer, seed=1), args=args, train_dataset=dataset,
                       processing_class=tokenizer)  # fmt: skip
    if name == "SDFT":
        return Trainer(model, args=args, train_dataset=dataset, processing_class=tokenizer)
    return Trainer(model, reward_funcs=says_a, args=args, train_dataset=dataset, processing_class=tokenizer)


ONLINE = {
    "RLOO": dict(num_generations=2),
    "GRPO": dict(num_generations=2),
    "GMPO": dict(num_generations=2),
    "OnlineDPO": dict(per_device_train_batch_size=2),
    "A2PO": dict(num_value_samples=2),
    "Distillation": dict(num_generations=2),
    "SDFT": dict(num_generations=2, distillation_topk=8),
    "SDPO": dict(num_generations=2),
}


@pytest.fixture
def watched(monkeypatch, caplog):
    """The fallback lines of this test only (the once-per-process memory emptied), and the generation calls that
    ran the lean loop / built a shared-prefix cache."""
    monkeypatch.setattr(fallbacks, "_reported", set())
    calls = {"lean": 0, "shared": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(lean, "generate_chunk", counting("lean", lean.generate_chunk))
    monkeypatch.setattr(batched, "generation_prefix_cache", counting("shared", batched.generation_prefix_cache))
    caplog.set_level(logging.INFO, logger="trl_unified")
    return calls, caplog


def fallback_lines(caplog) -> list[str]:
    markers = ("without prompt sharing", "instead of the lean loop", "come from the model's logits", "padded rows")
    return [r.getMessage() for r in caplog.records if any(m in r.getMessage() for m in markers)]


@pytest.mark.parametrize("name", list(ONLINE))
def test_online_defaults_take_the_fast_paths(name, tokenizer, tmp_path, watched):
    calls, caplog = watched
    trainer = online(name, tokenizer, tmp_path, **ONLINE[name])
    trainer.train()
    assert fallback_lines(caplog) == []
    assert calls["lean"] > 0, "generation did not run the lean loop"
    if trainer.args.num_generations > 1:
        assert calls["shared"] > 0, "the group's prompt was not shared in generation"


def preference_rows(name):
    words = "a b c d e f g h".split()
    rows = {"prompt": [" ".join(words[i : i + 2]) for i in range(4)]}
    if name == "KTO":
        rows.update(completion=[" a b", " g h", " c d", " e f"], label=[True, False, True, False])
    else:
        rows.update(chosen=[" a b", " c d", " a c", " b d"], rejected=[" g h", " e f", " h e", " f g"])
    if name == "TPO":
        rows["reference"] = rows["chosen"]
    return Dataset.from_dict(rows)


@pytest.mark.parametrize("name", ["DPO", "KTO", "ORPO", "CPO", "TPO"])
def test_preference_defaults_take_the_fast_paths(name, tokenizer, tmp_path, watched):
    _, caplog = watched
    Config, Trainer = getattr(trl_unified, f"{name}Config"), getattr(trl_unified, f"{name}Trainer")
    args = tiny_run_args(Config, tmp_path, max_steps=1)
    trainer = Trainer(build_causal_lm(tokenizer), args=args, train_dataset=preference_rows(name),
                      processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert fallback_lines(caplog) == []


def test_the_guard_sees_a_fallback(tokenizer, tmp_path, watched):
    """The assertions above can fail: with the lean loop and prompt sharing switched off, both are reported."""
    calls, caplog = watched
    trainer = online("GRPO", tokenizer, tmp_path, num_generations=2, lean_decoding=False, shared_prefix=False)
    trainer.train()
    assert any("instead of the lean loop" in line for line in fallback_lines(caplog))
    assert calls == {"lean": 0, "shared": 0}
