# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified kto` and `examples/kto.py`: the offline demo without arguments, a TRL-style script otherwise."""

import sys

from trl_unified import KTOConfig, KTOTrainer
from trl_unified.scripts import preference


def make_parser(prog=None, argv=None):
    return preference.make_parser(KTOTrainer, KTOConfig, prog, argv)


def main():
    preference.main(KTOTrainer, KTOConfig)


if __name__ == "__main__":
    sys.exit(main())
