"""The KV cache over a ``pagedllm bench compare`` run, every layout side by side, as a GIF.

Each panel is one layout's cache, one cell per token slot (a paged block's state repeated over
its block_size slots, so every panel has the same slots and the same geometry), coloured as the
server's /kv page colours block states. Frames are on a common engine-time axis: at each frame
time every panel shows its state of the step running then (a layout that finished shows its
last step). Written with matplotlib's PillowWriter, so only when pillow is installed.
"""

from __future__ import annotations

import math
import os

import numpy as np

from pagedllm.bench.report.plots import _plt
from pagedllm.bench.report.tables import LAYOUT_LABELS
from pagedllm.kv import block_view

# The /kv page's colours (entrypoints/openai/kv_view.html), by state code.
STATE_COLORS = {
    block_view.FREE: "#e8eaee",
    block_view.CACHED: "#bbe6c8",
    block_view.USED: "#3d7ae0",
    block_view.SHARED: "#f08c28",
    block_view.SWAPPING: "#965ac8",
    block_view.RESERVED: "#fad678",
}


def have_pillow() -> bool:
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def _frame_at(frames: list[tuple[float, np.ndarray]], t: float) -> int:
    """Index of the step running at engine time t (a frame's time is its step's end)."""
    lo, hi = 0, len(frames) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if frames[mid][0] < t:
            lo = mid + 1
        else:
            hi = mid
    return lo


def animate_kv(result: dict, path: str, num_frames: int = 90, fps: int = 10) -> str | None:
    """Writes the GIF from ``result["layouts"][name]["block_frames"]``; None without pillow or frames."""
    layouts = {n: r for n, r in result["layouts"].items() if r.get("block_frames")}
    if not layouts or not have_pillow():
        return None
    from matplotlib.animation import FuncAnimation, PillowWriter
    from matplotlib.colors import ListedColormap

    plt = _plt()
    names = list(layouts)
    slots = {n: len(r["block_frames"][0][1]) * r["block_size"] for n, r in layouts.items()}
    num_slots = max(slots.values())
    cols = int(math.ceil(math.sqrt(num_slots * 2)))
    rows = int(math.ceil(num_slots / cols))
    cmap = ListedColormap([STATE_COLORS[k] for k in sorted(STATE_COLORS)])
    end = max(r["block_frames"][-1][0] for r in layouts.values())
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 2.6), squeeze=False)
    images, titles = [], []
    for ax, name in zip(axes[0], names, strict=True):
        ax.set_xticks([])
        ax.set_yticks([])
        images.append(ax.imshow(np.zeros((rows, cols)), cmap=cmap, vmin=-0.5, vmax=len(STATE_COLORS) - 0.5))
        titles.append(ax.set_title(LAYOUT_LABELS.get(name, name), fontsize=8))
    caption = fig.suptitle("", fontsize=9)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=STATE_COLORS[k])
        for k in (block_view.FREE, block_view.USED, block_view.SHARED)
    ]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=STATE_COLORS[block_view.RESERVED]))
    fig.legend(
        handles, ["free", "holding tokens", "shared", "reserved, unused"], loc="lower center", ncol=4, fontsize=7
    )

    def grid(name: str, states: np.ndarray) -> np.ndarray:
        per_slot = np.repeat(states, layouts[name]["block_size"])
        out = np.full(rows * cols, block_view.FREE, dtype=np.uint8)
        out[: per_slot.size] = per_slot
        return out.reshape(rows, cols)

    def draw(f: int):
        t = end * f / (num_frames - 1)
        for img, title, name in zip(images, titles, names, strict=True):
            frames = layouts[name]["block_frames"]
            i = _frame_at(frames, t)
            states = frames[i][1]
            img.set_data(grid(name, states))
            bs = layouts[name]["block_size"]
            in_use = int(np.isin(states, (block_view.USED, block_view.SHARED)).sum()) * bs
            unused = int((states == block_view.RESERVED).sum()) * bs
            done = " (done)" if t > frames[-1][0] else ""
            title.set_text(f"{LAYOUT_LABELS.get(name, name)}{done}\nslots in use {in_use}, reserved unused {unused}")
        caption.set_text(f"KV cache over the run, engine time {t:.1f} s")
        return [*images, *titles, caption]

    fig.tight_layout(rect=(0, 0.08, 1, 0.92))
    anim = FuncAnimation(fig, draw, frames=num_frames, blit=False)
    anim.save(path, writer=PillowWriter(fps=fps))
    plt.close(fig)
    return path


def write_kv_animation(result: dict, out_dir: str) -> list[str]:
    path = animate_kv(result, os.path.join(out_dir, "compare_kv_animation.gif"))
    return [path] if path else []
