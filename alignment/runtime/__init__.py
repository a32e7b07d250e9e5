"""Process-level plumbing every layer above uses: `dist` (rank, world, engine, the one logger), `progress`
(rich progress bars on rank 0), `redact` (secrets out of logs and stage.json), `files` (atomic writes)."""
