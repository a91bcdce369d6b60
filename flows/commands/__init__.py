"""The `emrl eval` command, until it joins the other commands in `cli.commands`."""
