"""The user tools of the `specdistill` command (train/cli.py), each also `python -m train.tools.NAME ...`."""
