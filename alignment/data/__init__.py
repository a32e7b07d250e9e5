"""Data: `loading` (a data spec -> datasets.Dataset, column checks, row numbers as written in the file) and
`formatting` (the ONE prompt/completion rendering and tokenization every stage and sampler uses)."""
