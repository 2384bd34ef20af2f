# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified orpo` and `examples/orpo.py`: TRL's dpo script with trl_unified's ORPOTrainer and ORPOConfig
(`scripts/trl_scripts.py`; TRL ships no orpo script), or with no model and no config the offline demo
(`scripts/preference.py`)."""

from trl_unified.scripts import preference, trl_scripts


make_parser, main = trl_scripts.entry_points("orpo", preference)


if __name__ == "__main__":
    main()
