# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified rloo` and `examples/rloo.py`: the offline demo without arguments, a TRL-style script otherwise."""

import sys

from trl_unified import RLOOConfig, RLOOTrainer
from trl_unified.scripts import online


def make_parser(prog=None, argv=None):
    return online.make_parser(RLOOTrainer, RLOOConfig, prog, argv)


def main():
    online.main(RLOOTrainer, RLOOConfig)


if __name__ == "__main__":
    sys.exit(main())
