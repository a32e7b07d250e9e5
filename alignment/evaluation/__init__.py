"""What evaluates and reports: `evaluate` (score checkpoints on suites: verifiers, reward model, KL), `report`
(comparisons with the baseline, the files, the Markdown table and PNG plots), `metrics` (pure metric math),
`block` (the recipe's `evaluate:` block), `handoff` (results of `--jobs` evaluation processes), `tool_suites`."""
