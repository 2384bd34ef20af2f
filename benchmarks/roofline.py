"""The machine's float32 matmul roofline as the trainers meet it: MKL's sgemm (`torch.mm`, `F.linear`, what training
runs on) against oneDNN's product on a weight packed once (what the lean decode loop and a frozen teacher run on,
`trl_unified/generation/packed_weights.py`), in GFLOP/s, for the shapes of SmolLM2-135M (576 -> 1536, 1536 -> 576,
576 -> 49152 for the head) at 16, 128 and 640 rows. Prints the CPU capability PyTorch dispatches to.

To see a CPU without AVX-512 on one that has it, cap the instruction sets for every library:
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/roofline.py

Usage: python benchmarks/roofline.py [--threads 2]
"""

import argparse
import os
import time

import torch


def gflops(fn, flops: float, seconds: float = 0.5) -> float:
    for _ in range(3):
        fn()
    reps = max(3, int(seconds * 2e11 / flops))
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return flops / ((time.perf_counter() - start) / reps) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    caps = {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    print(f"capability {torch.backends.cpu.get_cpu_capability()}, threads {args.threads}, caps {caps}")
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    print(f"sgemm 2048 x 2048: {gflops(lambda: a @ b, 2 * 2048**3):.0f} GFLOP/s")
    for rows in (16, 128, 640):
        for k, n in ((576, 1536), (1536, 576), (576, 49152)):
            x, w = torch.randn(rows, k), torch.randn(n, k)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            flops = 2 * rows * k * n
            mkl = gflops(lambda: torch.nn.functional.linear(x, w), flops)  # noqa: B023
            onednn = gflops(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), flops)  # noqa: B023
            print(f"{rows:4d} rows x {k} -> {n}: F.linear (MKL) {mkl:4.0f}  packed (oneDNN) {onednn:4.0f} GFLOP/s")


if __name__ == "__main__":
    main()
