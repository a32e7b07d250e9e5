"""Run a recipe under `accelerate launch` (every process runs every stage; rank 0 writes files).

    accelerate launch --config_file configs/accelerate/ddp.yaml scripts/run_recipe.py RECIPE [key=value ...]

Same arguments and options as `align run`.
"""

import sys

from alignment.cli import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "run", *sys.argv[1:]]
    main()
