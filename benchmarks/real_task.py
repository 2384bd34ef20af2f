"""A real pretrained model on a real task: trl_unified vs TRL 1.16 on SmolLM2-135M-Instruct learning one-digit
addition (the task of `examples/arithmetic.py`: same data, reward, settings and seeds). `--trainer rloo` (default) or
`grpo`: online, the reward is 1 for the right sum; `dpo`: preference pairs built from the same problems, the right sum
chosen and a sum off by 1 or 2 rejected (8 pairs per step, beta 0.1).

Each run trains in its own fresh subprocess (so peak RSS is its own), TRL then ours, `--repeats` times alternating.
After training, the held-out accuracy of both is measured by the same code (greedy `generate_batched`, the last
number of the generation against a + b, 40 held-out problems). Printed: per library the seconds per step and where
they go (generation, reference forward, optimiser, the rest: the policy's forward and backward), then

    ratio step_time=X peak_rss=Y            (ours / TRL's: median seconds per step, first step excluded; peak RSS)
    accuracy before=B ours=A trl=T          (held-out accuracy of the base model, then after training)

and `benchmarks/real_task_curve.png` (train reward of both against steps).

Usage: python benchmarks/real_task.py [--trainer rloo|grpo|dpo] [--steps 60] [--repeats 1] [--threads 2] [--seed 0]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def held_out_accuracy(model, tokenizer, rows) -> float:
    from arithmetic import last_number
    from transformers import GenerationConfig

    from trl_unified import generate_batched

    config = GenerationConfig(
        max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    out = generate_batched(model.eval(), tokenizer, rows["prompt"], generation_config=config, batch_size=40)
    return sum(last_number(t) == a for t, a in zip(out.texts, rows["answer"], strict=True)) / len(rows["answer"])


def preference_pairs(rows, seed: int) -> dict:
    """The train problems as DPO pairs: the right sum chosen, a sum off by 1 or 2 (never negative) rejected."""
    rng = random.Random(seed)
    wrong = [str(max(0, int(a) + rng.choice([-2, -1, 1, 2])) if int(a) > 1 else int(a) + 1) for a in rows["answer"]]
    return {
        "prompt": rows["prompt"],
        "chosen": [[{"role": "assistant", "content": a}] for a in rows["answer"]],
        "rejected": [[{"role": "assistant", "content": w}] for w in wrong],
    }


def build_trainer(library, trainer: str, path: str, steps: int, seed: int, callbacks):
    from arithmetic import problems, sum_correct, training_config
    from datasets import Dataset
    from transformers import AutoTokenizer

    train_rows, _ = problems()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if trainer == "dpo":
        args = library.DPOConfig(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, learning_rate=5e-6, beta=0.1,
            max_steps=steps, logging_steps=5, bf16=False, gradient_checkpointing=False, save_strategy="no",
            report_to="none", seed=seed,
        )  # fmt: skip
        data = Dataset.from_dict(preference_pairs(train_rows, seed))
        return library.DPOTrainer(path, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    name = trainer.upper()
    return getattr(library, f"{name}Trainer")(
        model=path,
        reward_funcs=sum_correct,
        args=training_config(getattr(library, f"{name}Config"), tempfile.mkdtemp(), steps, seed),
        train_dataset=Dataset.from_dict(train_rows),
        processing_class=tokenizer,
        callbacks=callbacks,
    )


def run_one(impl: str, trainer_name: str, steps: int, seed: int, out: str) -> None:
    from arithmetic import problems
    from step_timer import PhaseTimer, StepTimer, peak_rss_kib

    from trl_unified.pretrained import smollm2_135m_instruct

    library = __import__("trl" if impl == "trl" else "trl_unified")
    timer, phases = StepTimer(), PhaseTimer()
    trainer = build_trainer(library, trainer_name, smollm2_135m_instruct(), steps, seed, [timer, phases])
    if trainer_name != "dpo":
        phases.watch("generation", trainer, "_generate" if impl == "trl" else "generate")  # as online_vs_trl.py
    if trainer.ref_model is not None:
        phases.watch("reference", trainer.ref_model)
    trainer.train()
    accuracy = held_out_accuracy(trainer.model, trainer.processing_class, problems()[1])
    curve = "reward" if trainer_name != "dpo" else "rewards/accuracies"  # DPO: pairs ranked right, per logged step
    rewards = [(log["step"], log[curve]) for log in trainer.state.log_history if curve in log]
    json.dump(
        {
            "times": timer.times,
            "phases": phases.phases,
            "accuracy": accuracy,
            "rewards": rewards,
            "peak_rss_mb": peak_rss_kib() / 1024,
        },
        open(out, "w"),
    )


def base_accuracy() -> float:
    from arithmetic import problems
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_unified.pretrained import smollm2_135m_instruct

    path = smollm2_135m_instruct()
    return held_out_accuracy(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                             problems()[1])  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description="SmolLM2-135M-Instruct, arithmetic: trl_unified vs TRL")
    parser.add_argument("--trainer", choices=["rloo", "grpo", "dpo"], default="rloo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        run_one(args.child[0], args.trainer, args.steps, args.seed, args.child[1])
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    before = base_accuracy()
    workdir = tempfile.mkdtemp()
    results = {"trl": [], "ours": []}
    for _ in range(args.repeats):
        for impl in ("trl", "ours"):
            out = os.path.join(workdir, f"{impl}.json")
            cmd = [sys.executable, __file__, "--trainer", args.trainer, "--steps", str(args.steps), "--threads",
                   str(args.threads), "--seed", str(args.seed), "--child", impl, out]  # fmt: skip
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[impl].append(json.load(open(out)))
    summary = {}
    for impl, runs in results.items():
        summary[impl] = {
            "step": statistics.median(statistics.median(r["times"][1:]) for r in runs),
            "rss": statistics.median(r["peak_rss_mb"] for r in runs),
            "accuracy": statistics.mean(r["accuracy"] for r in runs),
        }
        s = summary[impl]
        print(f"{impl:5s} {s['step']:.2f} s/step  peak RSS {s['rss']:.0f} MB  held-out accuracy {s['accuracy']:.3f}")
        phases = {
            phase: statistics.median(statistics.median(r["phases"][phase][1:]) for r in runs)
            for phase in runs[0]["phases"]
        }
        split = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phases.items())
        print(f"      where the time goes (s/step): {split}, the rest {s['step'] - sum(phases.values()):.2f}")
    name = "" if args.trainer == "rloo" else f"_{args.trainer}"
    save_curve(results, os.path.join(HERE, f"real_task_curve{name}.png"), before, args.trainer)
    ours, trl = summary["ours"], summary["trl"]
    print(f"ratio step_time={ours['step'] / trl['step']:.2f} peak_rss={ours['rss'] / trl['rss']:.2f}")
    print(f"accuracy before={before:.3f} ours={ours['accuracy']:.3f} trl={trl['accuracy']:.3f}")


def save_curve(results, path, before, trainer="rloo"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for impl, style in (("ours", "-"), ("trl", "--")):
        run = results[impl][0]
        what = "train reward" if trainer != "dpo" else "pairs ranked right"
        ax.plot(*zip(*run["rewards"]), style, marker="o", markersize=3, label=f"{what}, {impl}")
        ax.scatter([run["rewards"][-1][0]], [run["accuracy"]], marker="s", s=40, label=f"held-out accuracy, {impl}")
    ax.axhline(before, color="gray", linestyle=":", label="held-out accuracy, base model")
    ax.set(xlabel="step", ylabel="fraction correct", ylim=(0, 1.05),
           title=f"SmolLM2-135M-Instruct, {trainer.upper()} on one-digit addition")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
