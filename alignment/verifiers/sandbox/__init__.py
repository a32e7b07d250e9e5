"""The sandbox: run untrusted Python (model-written code plus unit tests) in a confined process.

Three files, coupled through source text rather than imports, so no import graph shows it:
`process.py` (the caller's side: isolation, limits, timeout, verdict) reads the *text* of `harness.py`
(runs inside the sandbox, standard library only, never imported) and of `safe_compare.py` (the tests'
comparisons on builtin data; imported by the `python_tests` verifier, and exec'd by the harness) and
sends it to the sandboxed interpreter as its payload.

So a change to `harness.py` or `safe_compare.py` changes what runs inside the sandbox without any import
changing: `EXIT_SYNTAX`/`EXIT_SETUP` in process.py must match the harness, and safe_compare.py must stay
standard-library only. What the sandbox does and does not cover: docs/sandbox.md.
"""
