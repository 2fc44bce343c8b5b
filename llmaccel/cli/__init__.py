"""The `llmaccel` command line: one module per command, each parsing its options and calling
a public API of the package that does the work; `root` assembles them."""

from llmaccel.cli.root import app, main

__all__ = ["app", "main"]
