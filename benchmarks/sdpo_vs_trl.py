"""SDPO: trl_unified vs TRL 1.16 on the same workload, in one run (see `online_vs_trl.py` for the workload).

Usage: python benchmarks/sdpo_vs_trl.py [--workload short|long|both] [--threads 2] [--steps 10] [--repeats 1]
Output: `ratio workload=short step_time=X peak_rss=Y` per workload (ours / TRL's).
"""

from online_vs_trl import main  # benchmarks/ is on sys.path when this script runs


if __name__ == "__main__":
    main("sdpo")
