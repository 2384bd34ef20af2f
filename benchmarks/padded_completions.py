"""One policy forward and backward over completions that end at different lengths, at Qwen2.5's vocabulary size:
TRL's scoring (the model's logits at every completion position, `trl.trainer.utils.selective_log_softmax`) against
trl_unified's `compute_token_logprobs` (the LM head in chunks from the hidden states, only real completion tokens
projected), the same with every completion position projected (trl_unified's behaviour before 2026-12-02), and the
rows packed without padding (`padding_free=True`, `core/packing.py`: no layer pays for the padding).

Model: the benchmarks' Qwen2-style model with `--vocab real` (151,665 tokens, tied embeddings, 105M parameters,
`online_vs_trl.build_model`) or `--vocab 8k`. Batch: 16 rows of 32 prompt tokens and 64 completion slots; completion
lengths drawn uniformly from `--min_length`-64 (seed 0), EOS then padding. The loss is the masked sum of log-probs
(its gradients are those of any policy-gradient loss over these tokens). Median of `--repeats` timed runs after one
warm-up, one process, `--threads` threads, the four ways alternating.

Usage: python benchmarks/padded_completions.py [--threads 2] [--repeats 3] [--vocab real|8k] [--min_length 4]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", choices=["real", "8k"], default="real", help="152k or 8k tokens")
    parser.add_argument("--min_length", type=int, default=4, help="shortest completion (64: no padding)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(__file__))
    from online_vs_trl import build_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import selective_log_softmax

    from trl_unified import compute_token_logprobs

    path = os.path.join(tempfile.mkdtemp(), "model")
    build_model(path, args.vocab)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    rows, prompt, width = 16, 32, 64
    lengths = torch.randint(args.min_length, width + 1, (rows,))
    ids = torch.randint(1, model.config.vocab_size, (rows, prompt + width))
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths.tolist()):
        mask[row, prompt + length :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    real = mask[:, prompt:].float()

    def trl():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt - 1 : -1]
        return selective_log_softmax(logits, ids[:, prompt:])

    def ours(**options):
        return compute_token_logprobs(model, ids, mask, width, **options).logps

    ways = {
        "trl": trl,
        "ours_all_positions": lambda: ours(score_padding=True, padding_free=False),
        "ours": lambda: ours(padding_free=False),
        "ours_packed": lambda: ours(padding_free=True),
    }
    times = {name: [] for name in ways}
    for repeat in range(args.repeats + 1):
        for name, way in ways.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            (way() * real).sum().backward()
            if repeat:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    print(f"real completion tokens: {int(real.sum())} of {rows * width} slots")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"{name}: {value:.3f} s  ratio to trl {value / medians['trl']:.2f}")


if __name__ == "__main__":
    main()
