"""Benchmark reports: markdown tables (``tables``) and matplotlib plots (``plots``).

``write_compare``, ``write_block_sizes`` and ``write_bs1`` write the reports of ``pagedllm bench
compare``'s three modes: each takes the mode's result dict (with full per-step ``samples``) and an
output folder, writes ``<mode>.md`` and PNGs (compare: also the KV animation, ``animation``), and
returns the paths it wrote.
"""

from __future__ import annotations

from pagedllm.bench.report.animation import write_kv_animation
from pagedllm.bench.report.plots import LAYOUT_COLORS, MEMORY_PARTS, _plt, plot_block_sizes, plot_compare, save_fig
from pagedllm.bench.report.tables import (
    LAYOUT_LABELS,
    dumps_json,
    md_table,
    write_block_sizes_md,
    write_bs1,
    write_compare_md,
)

__all__ = [
    "LAYOUT_COLORS",
    "LAYOUT_LABELS",
    "MEMORY_PARTS",
    "_plt",
    "dumps_json",
    "md_table",
    "save_fig",
    "write_block_sizes",
    "write_bs1",
    "write_compare",
]


def write_compare(result: dict, out_dir: str) -> list[str]:
    return plot_compare(result, out_dir) + write_kv_animation(result, out_dir) + [write_compare_md(result, out_dir)]


def write_block_sizes(result: dict, out_dir: str) -> list[str]:
    return plot_block_sizes(result, out_dir) + [write_block_sizes_md(result, out_dir)]
