"""Keep secrets out of everything we write (stage.json, model cards, logs).

Masks values under keys that look secret (token, key, secret, password, ...) and any string that
contains the value of a secret-looking environment variable (HF_TOKEN, WANDB_API_KEY, ...).
"""

from __future__ import annotations

import os
import re
from typing import Any

SECRET_KEY = re.compile(r"(token|secret|password|passwd|api[_-]?key|access[_-]?key|credential)", re.I)
MASK = "***"


def secret_values() -> list[str]:
    """Values of environment variables whose names look secret (8+ characters, to avoid masking '1')."""
    return [v for k, v in os.environ.items() if SECRET_KEY.search(k) and len(v) >= 8]


def redact(value: Any, secrets: list[str] | None = None, key: str = "") -> Any:
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, dict):
        return {k: redact(v, secrets, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets, key) for v in value]
    if isinstance(value, str):
        if key and SECRET_KEY.search(key) and not key.endswith(("_tokens", "_token_id", "tokens")) and value:
            return MASK
        for secret in secrets:
            value = value.replace(secret, MASK)
    return value
