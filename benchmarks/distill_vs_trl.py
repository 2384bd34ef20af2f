"""trl_unified's DistillationTrainer (or GKDTrainer) against TRL 1.16's on the workload of `examples/distill.py`:
SmolLM2-135M-Instruct teaching a student built from it (`--layers`: 24 of its 30 layers as in the example, or fewer),
the one-digit addition prompts, 16 completions of at most 16 tokens per step, float32, no evaluation. Distillation:
reverse KL (beta = 1). `--trainer gkd`: TRL's experimental GKDTrainer and ours (beta 0.5, the gold answers as the
dataset's completions), with `--lmbda 1` (every step the student's samples) or `--lmbda 0` (the dataset's: no
generation), so that both libraries do the same rounds.

`--teacher server` compares ours with itself: the teacher in the training process against the teacher on a server (a
separate process answering vLLM's prompt log-probs, `tests/jobs/vllm_server_stand_in.py`, top-16 with the tail):
`--teacher_depth k` makes the teacher larger (each of its layers k times) in both arms. Printed: the student process's
peak RSS while training (the high-water mark is reset once the models are built: the student is
cut from the teacher, so both arms load the teacher once) and step time.

Each run trains in its own fresh subprocess (peak RSS is its own), `--repeats` times alternating. Printed per run kind:
median seconds per step (first step excluded) and peak RSS, then `ratio step_time=X peak_rss=Y` (first / second).

Usage: python benchmarks/distill_vs_trl.py [--trainer distillation|gkd] [--lmbda 1] [--teacher local|server]
       [--teacher_depth 1]
       [--steps 8] [--repeats 1] [--threads 2] [--layers 24]
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(library, steps, out, layers=24, trainer_name="distillation", lmbda=1.0, url=None, teacher_depth=1):
    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    import torch
    from arithmetic import problems
    from datasets import Dataset
    from distill import build_student, with_messages
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_unified.pretrained import smollm2_135m_instruct

    if library == "trl" and trainer_name == "gkd":
        from trl.experimental.gkd import GKDConfig as Config
        from trl.experimental.gkd import GKDTrainer as Trainer
    elif library == "trl":
        from trl import DistillationConfig as Config
        from trl import DistillationTrainer as Trainer
    elif trainer_name == "gkd":
        from trl_unified import GKDConfig as Config
        from trl_unified import GKDTrainer as Trainer
    else:
        from trl_unified import DistillationConfig as Config
        from trl_unified import DistillationTrainer as Trainer
    path = smollm2_135m_instruct(use_hub=False)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    student = build_student(teacher, layers)
    train, _ = problems(40)
    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, learning_rate=1e-4, max_steps=steps,
        logging_steps=1, bf16=False, gradient_checkpointing=False, save_strategy="no", report_to="none", seed=0,
    )  # fmt: skip
    if trainer_name == "gkd":
        config = Config(max_new_tokens=16, lmbda=lmbda, max_length=256, **common)
        train = {"messages": with_messages(train)["messages"]}  # TRL reads a `prompt` column as rendered text
    else:
        config = Config(max_completion_length=16, **common)
    teacher_arm = url  # the --teacher server comparison: "in-process" or the server's URL; else None
    if url == "in-process":  # the server comparison's baseline: the same loss (forward KL), the teacher here
        config, url = Config(max_completion_length=16, beta=0.0, **common), None
        teacher = deepened(teacher, teacher_depth)
    elif url is not None:  # the teacher on a server: this process holds the student only
        config = Config(max_completion_length=16, teacher_model_server_url=url, beta=0.0, loss_top_k=16, **common)
        del teacher
        gc.collect()

    from step_timer import StepTimer, peak_rss_kib, reset_peak_rss

    if teacher_arm is not None:  # the student is cut from the teacher: count training's peak, not the build's
        reset_peak_rss()

    timer = StepTimer()
    teacher_model = None if url is not None else teacher
    trainer = Trainer(model=student, teacher_model=teacher_model, args=config, train_dataset=Dataset.from_dict(train),
                      processing_class=tokenizer, callbacks=[timer])  # fmt: skip
    trainer.train()
    result = {"step_s": statistics.median(timer.times[1:]),
              "peak_rss_gb": peak_rss_kib() / 1024**2}  # fmt: skip
    with open(out, "w") as f:
        json.dump(result, f)


def deepened(teacher, depth: int):
    """`teacher` with each decoder layer repeated `depth` times (copies): a larger model of the same vocabulary, for
    the memory comparison (its outputs are not a trained model's)."""
    if depth > 1:
        import copy

        import torch

        layers = [copy.deepcopy(layer) for layer in teacher.model.layers for _ in range(depth)]
        for index, layer in enumerate(layers):
            layer.self_attn.layer_idx = index
        teacher.model.layers = torch.nn.ModuleList(layers)
        teacher.config.num_hidden_layers = len(layers)
        if getattr(teacher.config, "layer_types", None):
            teacher.config.layer_types = [teacher.config.layer_types[0]] * len(layers)
    return teacher


def serve_teacher(port_file: str, depth: int = 1) -> None:
    """The teacher (SmolLM2-135M-Instruct) behind vLLM's prompt log-probs API, in this process, until killed."""
    sys.path.insert(0, os.path.join(HERE, ".."))
    import torch
    from transformers import AutoModelForCausalLM

    from tests.jobs.vllm_server_stand_in import VLLMServerStandIn
    from trl_unified.pretrained import smollm2_135m_instruct

    teacher = AutoModelForCausalLM.from_pretrained(smollm2_135m_instruct(use_hub=False), dtype=torch.float32)
    server = VLLMServerStandIn(teacher=deepened(teacher, depth).eval())
    with open(port_file, "w") as f:
        f.write(server.url)
    while True:
        time.sleep(60)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--trainer", choices=["distillation", "gkd"], default="distillation")
    parser.add_argument("--lmbda", type=float, default=1.0, help="GKD: 1 every step on-policy, 0 never.")
    parser.add_argument("--teacher", choices=["local", "server"], default="local")
    parser.add_argument("--teacher_depth", type=int, default=1, help="--teacher server: each teacher layer k times.")
    parser.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._serve:
        return serve_teacher(args._serve, args.teacher_depth)
    if args._one:
        return run_one(
            args._one, args.steps, args._out, args.layers, args.trainer, args.lmbda, args._url, args.teacher_depth
        )
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "0"}
    server, url = None, None
    kinds = {"trl_unified": None, "trl": None}
    if args.teacher == "server":  # ours with the teacher in-process, then on a server
        port_file = tempfile.mktemp()
        serve = [sys.executable, __file__, "--_serve", port_file, "--teacher_depth", str(args.teacher_depth)]
        server = subprocess.Popen(serve, env=env)
        while not os.path.exists(port_file) or not open(port_file).read():
            time.sleep(1)
        url = open(port_file).read()
        kinds = {"teacher on a server": url, "teacher in process": "in-process"}  # ratio: server / in-process
    results = {kind: [] for kind in kinds}
    try:
        for _ in range(args.repeats):
            for kind, kind_url in kinds.items():
                out = tempfile.mktemp(suffix=".json")
                library = "trl" if kind == "trl" else "trl_unified"
                cmd = [sys.executable, __file__, "--_one", library, "--_out", out, "--steps", str(args.steps)]
                cmd += ["--layers", str(args.layers), "--trainer", args.trainer, "--lmbda", str(args.lmbda)]
                cmd += ["--teacher_depth", str(args.teacher_depth)]
                cmd += ["--_url", kind_url] if kind_url else []
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results[kind].append(json.load(open(out)))
    finally:
        if server is not None:
            server.kill()
    medians = {kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in results.items()}
    print(f"trainer={args.trainer} lmbda={args.lmbda} teacher={args.teacher} threads={args.threads} "
          f"steps={args.steps} repeats={args.repeats} layers={args.layers}")  # fmt: skip
    for kind, m in medians.items():
        print(f"{kind:20s} {m['step_s']:.2f} s/step  peak RSS {m['peak_rss_gb']:.2f} GB")
    first, second = medians.values()
    time_ratio, rss_ratio = first["step_s"] / second["step_s"], first["peak_rss_gb"] / second["peak_rss_gb"]
    print(f"ratio step_time={time_ratio:.2f} peak_rss={rss_ratio:.2f}")


if __name__ == "__main__":
    main()
