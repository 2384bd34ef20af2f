# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified dpo` and `examples/dpo.py`: the offline demo without arguments, a TRL-style script otherwise."""

import sys

from trl_unified import DPOConfig, DPOTrainer
from trl_unified.scripts import preference


def make_parser(prog=None, argv=None):
    return preference.make_parser(DPOTrainer, DPOConfig, prog, argv)


def main():
    preference.main(DPOTrainer, DPOConfig)


if __name__ == "__main__":
    sys.exit(main())
