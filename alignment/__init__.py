"""Alignment post-training toolkit: SFT, reward models, PPO, DPO, RSFT and RLVR chained by YAML recipes.

Importing the package is cheap on purpose (no torch/transformers import here); the CLI is
`align` (see `alignment.cli`) and recipes run with `align run RECIPE`.
"""

__version__ = "0.1.0"
