"""What evaluates and reports: `evaluate` (score checkpoints on suites: verifiers, reward model, KL, win
rate), `metrics` (pure metric functions), `report` (the Markdown table and PNG plots)."""
