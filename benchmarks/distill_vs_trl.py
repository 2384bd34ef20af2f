"""trl_unified's DistillationTrainer against TRL 1.16's on the workload of `examples/distill.py`: SmolLM2-135M-Instruct
teaching a student built from it (`--layers`: 24 of its 30 layers as in the example, or fewer), the one-digit
addition prompts, 16 completions of at most 16 tokens per step, reverse KL (beta = 1), float32, no evaluation.

Each run trains in its own fresh subprocess (peak RSS is its own), ours then TRL's, `--repeats` times alternating.
Printed per library: median seconds per step (first step excluded) and peak RSS, then `ratio step_time=X
peak_rss=Y` (ours / TRL's).

Usage: python benchmarks/distill_vs_trl.py [--steps 8] [--repeats 1] [--threads 2] [--layers 24]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(library: str, steps: int, out: str, layers: int = 24) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import torch
    from arithmetic import problems
    from datasets import Dataset
    from distill import build_student
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trl_unified.pretrained import smollm2_135m_instruct

    if library == "trl":
        from trl import DistillationConfig, DistillationTrainer
    else:
        from trl_unified import DistillationConfig, DistillationTrainer
    path = smollm2_135m_instruct(use_hub=False)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    student = build_student(teacher, layers)
    train, _ = problems(40)
    config = DistillationConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, max_completion_length=16, learning_rate=1e-4,
        max_steps=steps, logging_steps=1, bf16=False, gradient_checkpointing=False, save_strategy="no",
        report_to="none", seed=0,
    )  # fmt: skip

    class Steps(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.start)

    timer = Steps()
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                  train_dataset=Dataset.from_dict(train), processing_class=tokenizer,
                                  callbacks=[timer])  # fmt: skip
    trainer.train()
    result = {"step_s": statistics.median(timer.times[1:]),
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one:
        return run_one(args._one, args.steps, args._out, args.layers)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "0"}
    results = {"trl_unified": [], "trl": []}
    for _ in range(args.repeats):
        for library in results:
            out = tempfile.mktemp(suffix=".json")
            cmd = [sys.executable, __file__, "--_one", library, "--_out", out, "--steps", str(args.steps),
                   "--layers", str(args.layers)]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[library].append(json.load(open(out)))
    medians = {lib: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for lib, runs in results.items()}
    print(f"threads={args.threads} steps={args.steps} repeats={args.repeats} layers={args.layers}")
    for library, m in medians.items():
        print(f"{library:12s} {m['step_s']:.2f} s/step  peak RSS {m['peak_rss_gb']:.2f} GB")
    ours, theirs = medians["trl_unified"], medians["trl"]
    time_ratio, rss_ratio = ours["step_s"] / theirs["step_s"], ours["peak_rss_gb"] / theirs["peak_rss_gb"]
    print(f"ratio step_time={time_ratio:.2f} peak_rss={rss_ratio:.2f}")


if __name__ == "__main__":
    main()
