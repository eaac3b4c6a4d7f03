"""The `boomfx` command line: argument parsing and dispatch to the library."""
