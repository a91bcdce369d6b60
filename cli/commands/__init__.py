"""The `emrl` commands, one module each: `add(sub, common)` declares the command's parser, `run(args)` runs it.

The options come from `cli.settings`; the cheap checks before Prefect starts from `cli.preflight`.
"""
