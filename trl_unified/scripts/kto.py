# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified kto` and `examples/kto.py`: TRL's kto script with trl_unified's classes
(`scripts/trl_scripts.py`), or with no model and no config the offline demo (`scripts/preference.py`)."""

from trl_unified.scripts import preference, trl_scripts


make_parser, main = trl_scripts.entry_points("kto", preference)


if __name__ == "__main__":
    main()
