"""The results as one table on stdout, every row of every section; the decode section's columns (GFLOP/s, of
roofline, vs plain) show "-" for the rows of the others.
"""

from __future__ import annotations


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "section", "variant", "rate", "unit", "peak MiB", "seconds", "MFU", "GFLOP/s", "of roofline", "vs plain"
    )
    for r in results:
        gflops, share, ratio = r.get("gflops"), r.get("of_roofline"), r.get("vs_plain")
        table.add_row(
            r["section"],
            r["variant"],
            f"{r['rate']:.1f}",
            r["unit"],
            f"{r['peak_mib']:.0f}",
            f"{r['seconds']:.1f}",
            f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
            f"{gflops:.2f}" if gflops is not None else "-",
            f"{share:.1%}" if share is not None else "-",
            f"{ratio:.2f}x" if ratio is not None else "-",
        )
    Console(width=240).print(table)  # a file or a pipe gets the whole table, not a terminal's width
