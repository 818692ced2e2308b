"""The command line: the typer app and the commands that are more than one library call."""
