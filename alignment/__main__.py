"""`python -m alignment` / `accelerate launch -m alignment run RECIPE`: the `align` CLI."""

from .cli import main

main()
