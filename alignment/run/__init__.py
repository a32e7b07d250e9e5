"""What runs a recipe: `runner` (stages in order, `stage.json` last, skip finished stages), `jobs` (the
`--jobs` scheduler that runs independent stages side by side), `model_card` (each output's README.md)."""
