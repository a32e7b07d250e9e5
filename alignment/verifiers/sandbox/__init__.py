"""The sandbox: run untrusted Python (model-written code plus unit tests) in a confined process.

Three files, coupled through source text rather than imports, so no import graph shows it:

    process.py        the caller's side: probes the isolation mode, builds the command (namespaces,
                      rlimits, stripped environment), starts the confined interpreter, enforces the
                      timeout, reads the bounded output and classifies the result. It reads the *text*
                      of the two files below and sends it to the sandboxed interpreter as its payload.
    harness.py        runs inside the sandbox (`python -I -S -B`, standard library only; never imported):
                      builds the file-system view, drops privileges, runs the solution then the tests,
                      and writes the per-run nonce only when its own frame saw the tests pass.
    safe_compare.py   standard library only; imported by the `python_tests` verifier to compile the tests,
                      and exec'd *by the harness* from its source text in a private namespace, where it
                      judges the tests' comparisons on builtin data only.

So a change to `harness.py` or `safe_compare.py` changes what runs inside the sandbox without any import
changing: `EXIT_SYNTAX`/`EXIT_SETUP` in process.py must match the harness, and safe_compare.py must stay
standard-library only. What the sandbox does and does not cover is in process.py's docstring.
"""
