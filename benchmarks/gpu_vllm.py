"""One prepared GPU check (for a session lent a CUDA machine; under 8 minutes): steps per second of trl_unified's
RLOO against TRL's on a randomly initialised ~0.5B Qwen2 (Qwen2.5-0.5B's shape, built from a config: the GPU machine
reaches no Hub), with and without vLLM (colocate) when vLLM imports there, else without.

Carry only this repository (pure Python); the machine's torch / transformers / trl are used. Run from the repository
root:  python benchmarks/gpu_vllm.py [--steps 8] [--length 128]
Prints one line per configuration: `<library> <engine> <steps/s> <peak GPU memory GB>`.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
import time


def tiny_tokenizer_and_model(tmp):
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from trl_unified.testing import build_tokenizer

    words = [f"w{i}" for i in range(4000)]  # a word-level vocabulary, so the prompts are real token sequences
    tokenizer: PreTrainedTokenizerFast = build_tokenizer(words)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    path = os.path.join(tmp, "model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    prompts = [" ".join(words[(7 * i + j) % len(words)] for j in range(64)) for i in range(256)]
    return path, tokenizer, prompts


def run(library, engine, path, tokenizer, prompts, steps, length):
    import torch
    from datasets import Dataset

    if library == "trl":
        from trl import RLOOConfig, RLOOTrainer
    else:
        from trl_unified import RLOOConfig, RLOOTrainer
    args = RLOOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=32, num_generations=8,
        max_completion_length=length, max_steps=steps, logging_steps=1, bf16=True, report_to="none",
        save_strategy="no", gradient_checkpointing=False, use_vllm=engine == "vllm", beta=0.0,
        **({"vllm_gpu_memory_utilization": 0.3} if engine == "vllm" else {}),
    )  # fmt: skip
    reward = lambda completions, **k: [len(c) / 100 for c in completions]
    dataset = Dataset.from_dict({"prompt": prompts})
    trainer = RLOOTrainer(path, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    times = [log["step_time"] for log in trainer.state.log_history if "step_time" in log][1:]
    if not times:  # TRL logs step_time too; fall back to the wall clock
        times = [trainer.state.log_history[-1]["train_runtime"] / steps]
    print(f"{library} {engine} {1 / (sum(times) / len(times)):.3f} steps/s "
          f"{torch.cuda.max_memory_allocated() / 1e9:.1f} GB", flush=True)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path, tokenizer, prompts = tiny_tokenizer_and_model(tmp)
        engines = ["lean"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
        for engine in engines:
            for library in ("trl_unified", "trl"):
                run(library, engine, path, tokenizer, prompts, args.steps, args.length)
    print(f"total {time.time() - start:.0f}s; vLLM {'available' if len(engines) > 1 else 'not installed here'}")


if __name__ == "__main__":
    main()
