"""`python -m llmaccel`: the `llmaccel` command where its script is not on PATH."""

from llmaccel.cli import main

main()
