"""RLOO: trl_unified vs TRL 1.16 on the same workload, in one run (see `online_vs_trl.py` for the workload).

Usage: python benchmarks/rloo_vs_trl.py [--threads 2] [--steps 10] [--repeats 1]
Last line: `ratio step_time=X peak_rss=Y` (ours / TRL's).
"""

from online_vs_trl import main  # benchmarks/ is on sys.path when this script runs


if __name__ == "__main__":
    main("rloo")
