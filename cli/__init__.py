"""The `emrl` command: argument parsing, one module per command, the run settings, the checks before Prefect starts,
Prefect's environment, the local Prefect server, Ctrl-C and child processes.

May import `flows`, `inference` and `emrl_data`; `flows` never imports it. Prefect is imported only when a command
runs a flow (after `cli.prefect_env` has set Prefect's environment).
"""
