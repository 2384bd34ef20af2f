"""The training scripts behind the `trl-unified` command and `examples/<name>.py` (one copy of each): every module
has `make_parser(prog=None, argv=None)` (a `trl.TrlParser`) and `main()`, and runs as a script."""
