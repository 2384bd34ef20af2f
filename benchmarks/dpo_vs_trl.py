"""Speed and memory of trl_unified's DPOTrainer (or KTOTrainer) vs TRL's, same workload, in one run.

Model: the Qwen2-style 33.8M-parameter model of `online_vs_trl.py` (random weights, 8k word-level vocabulary), fp32
on CPU, gradient checkpointing off. Data: 256 pairs, prompts of 48-56 words, chosen and rejected completions of
24-40 words; batch 8 pairs, beta 0.1, sigmoid loss, 10 steps, reference model a frozen copy. Each trainer runs in its
own fresh subprocess (so peak RSS is its own), TRL then ours, `--repeats` times alternating. Printed: median seconds
per step (first step excluded) and peak RSS per implementation, then

    ratio step_time=X peak_rss=Y        (ours / TRL's)

Usage: python benchmarks/dpo_vs_trl.py [--trainer dpo|kto] [--threads 2] [--steps 10] [--repeats 1]
    [--precompute_ref_log_probs]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile


def run_one(trainer: str, impl: str, model_path: str, steps: int, out: str, precompute: bool) -> None:
    from datasets import Dataset
    from step_timer import StepTimer
    from transformers import PreTrainedTokenizerFast

    library = __import__("trl" if impl == "trl" else "trl_unified")
    name = trainer.upper()
    config_class, trainer_class = getattr(library, f"{name}Config"), getattr(library, f"{name}Trainer")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)

    def words(i, n, salt):
        return " ".join(f"w{(i * salt + j * 13) % 8000}" for j in range(n))

    rows = {
        "prompt": [words(i, 48 + i % 9, 37) for i in range(256)],
        "chosen": [" " + words(i, 24 + i % 17, 41) for i in range(256)],
        "rejected": [" " + words(i, 24 + (i * 7) % 17, 43) for i in range(256)],
    }

    timer = StepTimer()
    args = config_class(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=8 if trainer == "dpo" else 16,  # KTO: 16 unpaired rows = 8 pairs
        max_steps=steps,
        learning_rate=1e-6,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
        max_length=256,
        precompute_ref_log_probs=precompute,
    )
    trainer_class(
        model_path,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    ).train()
    json.dump({"times": timer.times, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
              open(out, "w"))  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description="DPO/KTO: trl_unified vs TRL on the same workload")
    parser.add_argument("--trainer", choices=["dpo", "kto"], default="dpo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--precompute_ref_log_probs", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        run_one(args.trainer, args.child[0], args.child[1], args.steps, args.child[2], args.precompute_ref_log_probs)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from online_vs_trl import build_model

    workdir = tempfile.mkdtemp()
    model_path = os.path.join(workdir, "model")
    build_model(model_path)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    results = {"trl": [], "ours": []}
    for _ in range(args.repeats):
        for impl in ("trl", "ours"):
            out = os.path.join(workdir, f"{impl}.json")
            cmd = [sys.executable, __file__, "--trainer", args.trainer, "--threads", str(args.threads), "--steps",
                   str(args.steps), *(["--precompute_ref_log_probs"] if args.precompute_ref_log_probs else []),
                   "--child", impl, model_path, out]  # fmt: skip
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[impl].append(json.load(open(out)))
    summary = {}
    for impl, runs in results.items():
        step = statistics.median(statistics.median(r["times"][1:]) for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        summary[impl] = (step, rss)
        print(f"{impl:>5} [{args.trainer}]: {step:.3f} s/step (median, first step excluded), peak RSS {rss:.0f} MB "
              f"[{args.threads} threads, {args.steps} steps, {args.repeats} run(s)]")  # fmt: skip
    ours, trl = summary["ours"], summary["trl"]
    print(f"ratio step_time={ours[0] / trl[0]:.2f} peak_rss={ours[1] / trl[1]:.2f}")


if __name__ == "__main__":
    main()
