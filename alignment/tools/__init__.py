"""Tools and environments for multi-turn rollouts, named in recipes like verifiers.

    registry.py   `tools:` / `environment:` -> callables and the JSON schemas shown to the model
    builtins.py   `calculator` (exact arithmetic via `ast`) and `python` (the verifier sandbox as an interpreter)
    formats.py    tool calls as the chat template writes them (hermes, llama3_json, mistral): prompt, parse, results
    rollout.py    the multi-turn rollout, token-in token-out: ids, a mask of sampled tokens, sampler log-probs
    worker.py     the recipe's own tools in a worker process, killed and replaced at a call's timeout
    openenv.py    OpenEnv environments: served on 127.0.0.1 for a stage or reached by URL, a session per rollout

The layer sits between `training/` (the stages' glue uses it) and `sampling/` (the rollout samples each turn
with the one sampler).
"""
