"""`minfer trace plot`: a Gantt chart of requests over time, KV slots held and batch size beneath.

HTML output is one self-contained file (inline SVG, no script, no dependency); PNG output uses
matplotlib when it is installed. Both draw the same three panels on one time axis:
  requests  one row each: waiting (queued -> admitted), prefill (admitted -> first token),
            decode (first token -> end), preempted stretches over them, aborts marked
  KV        slots held by live requests (allocated, not yet released; borrowed prefix-cache
            slots are not counted), with the pool size as a line when known
  batch     requests per forward pass, prefill and decode passes apart
"""

from __future__ import annotations

import html
import math
import os

from minfer.observability.timeline import Timeline, build_timeline

COLORS = {
    "waiting": "#c8c8c8",
    "prefill": "#f39c12",
    "decode": "#2e86de",
    "preempted": "#e74c3c",
    "kv": "#8e44ad",
    "pool": "#555555",
}
WIDTH, LEFT, RIGHT = 1100, 70, 20
GANTT_MAX_HEIGHT, PANEL_HEIGHT, GAP = 600, 140, 30


def plot_trace(events: list[dict], out_path: str, pool_tokens: int | None = None) -> None:
    """Write the plot to `out_path`; the extension picks the format (.html/.htm/.svg or .png)."""
    tl = build_timeline(events)
    ext = os.path.splitext(out_path)[1].lower()
    if ext in (".html", ".htm"):
        body = render_svg(tl, pool_tokens)
        title = f"minfer trace: {sum(1 for r in tl.requests.values() if r.queued is not None)} requests"
        doc = (
            f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            "<style>body{font-family:sans-serif;margin:16px}svg text{font-size:11px}</style></head>\n"
            f"<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n"
        )
        with open(out_path, "w") as f:
            f.write(doc)
    elif ext == ".svg":
        with open(out_path, "w") as f:
            f.write(render_svg(tl, pool_tokens))
    elif ext == ".png":
        render_png(tl, out_path, pool_tokens)
    else:
        raise ValueError(f"cannot tell the format of {out_path!r}: use .html, .svg or .png")


# -- SVG -----------------------------------------------------------------------------------------
class _Svg:
    def __init__(self):
        self.parts: list[str] = []

    def add(self, tag: str, text: str | None = None, title: str | None = None, **attrs) -> None:
        a = " ".join(f'{k.rstrip("_").replace("_", "-")}="{html.escape(str(v))}"' for k, v in attrs.items())
        inner = (f"<title>{html.escape(title)}</title>" if title else "") + (
            html.escape(text) if text else ""
        )
        self.parts.append(f"<{tag} {a}>{inner}</{tag}>" if inner else f"<{tag} {a}/>")


def _ticks(span: float, n: int = 8) -> list[float]:
    """Round tick positions in [0, span]: steps of 1, 2 or 5 times a power of ten."""
    if span <= 0:
        return [0.0]
    raw = span / n
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def _thin(points: list[tuple[float, float]], x_of, width: int) -> list[tuple[float, float]]:
    """At most a few points per pixel column: the first, the max and the last of each, which
    keeps a step line's peaks while a long trace stays a small file."""
    if len(points) <= 4 * width:
        return points
    out: list[tuple[float, float]] = []
    column: list[tuple[float, float]] = []
    for p in points:
        if column and int(x_of(p[0])) != int(x_of(column[0][0])):
            out += sorted({column[0], max(column, key=lambda q: q[1]), column[-1]})
            column = []
        column.append(p)
    if column:
        out += sorted({column[0], max(column, key=lambda q: q[1]), column[-1]})
    return out


def render_svg(tl: Timeline, pool_tokens: int | None = None) -> str:
    reqs = sorted((r for r in tl.requests.values() if r.queued is not None), key=lambda r: (r.start, r.uid))
    t0, t1 = tl.t0, max(tl.t1, tl.t0 + 1e-6)
    plot_w = WIDTH - LEFT - RIGHT

    def x(t: float) -> float:
        return LEFT + (t - t0) / (t1 - t0) * plot_w

    row_h = max(1.0, min(14.0, GANTT_MAX_HEIGHT / max(1, len(reqs))))
    gantt_h = row_h * len(reqs)
    kv_top = 20 + gantt_h + GAP
    batch_top = kv_top + PANEL_HEIGHT + GAP
    height = batch_top + PANEL_HEIGHT + 40
    svg = _Svg()
    axis_y = batch_top + PANEL_HEIGHT
    svg.add("rect", x=0, y=0, width=WIDTH, height=height, fill="white")
    # Legend.
    lx = LEFT
    for name in ("waiting", "prefill", "decode", "preempted"):
        svg.add("rect", x=lx, y=4, width=10, height=10, fill=COLORS[name])
        svg.add("text", name, x=lx + 14, y=13)
        lx += 90
    # Time axis (first, so that everything else is drawn over its grid).
    for t in _ticks(t1 - t0):
        tx = x(t0 + t)
        svg.add("line", x1=f"{tx:.2f}", x2=f"{tx:.2f}", y1=20, y2=axis_y + 4, stroke="#eeeeee")
        svg.add("text", f"{t:.4g} s", x=f"{tx - 10:.2f}", y=axis_y + 18)
    # Gantt.
    for i, r in enumerate(reqs):
        y = 20 + i * row_h
        end = r.end if r.end is not None else t1
        admitted = r.admitted if r.admitted is not None else end
        first = r.first_token if r.first_token is not None else end
        title = (
            f"uid {r.uid}: prompt {r.prompt_len}, hit {r.hit_tokens}, {r.output_len} tokens, "
            f"queue {_ms(r.queue_wait)} ms, ttft {_ms(r.ttft)} ms, e2e {_ms(r.e2e)} ms, {r.end_reason}"
        )
        segments = [("waiting", r.queued, admitted), ("prefill", admitted, first), ("decode", first, end)]
        for name, a, b in segments:
            if b > a:
                svg.add(
                    "rect",
                    title=title,
                    x=f"{x(a):.2f}",
                    y=f"{y:.2f}",
                    width=f"{max(0.5, x(b) - x(a)):.2f}",
                    height=f"{max(0.8, row_h - 1):.2f}",
                    fill=COLORS[name],
                )
        for a, b in r.preemptions:
            b = b if b is not None else end
            svg.add(
                "rect",
                title=f"uid {r.uid} preempted",
                x=f"{x(a):.2f}",
                y=f"{y:.2f}",
                width=f"{max(0.5, x(b) - x(a)):.2f}",
                height=f"{max(0.8, row_h - 1):.2f}",
                fill=COLORS["preempted"],
                fill_opacity=0.7,
            )
        if r.end_reason == "abort":
            svg.add(
                "text",
                "x",
                title=f"uid {r.uid} aborted",
                x=f"{x(end) + 2:.2f}",
                y=f"{y + row_h:.2f}",
                fill=COLORS["preempted"],
            )
    svg.add(
        "text",
        f"requests ({len(reqs)})",
        x=4,
        y=20 + gantt_h / 2,
        transform=f"rotate(-90 12 {20 + gantt_h / 2})",
    )
    # KV held.
    kv_points = [(t0, 0), *tl.kv_held]
    kv_max = max([v for _, v in kv_points] + [pool_tokens or 0, 1])
    _panel(
        svg,
        kv_top,
        f"KV slots held (max {max(v for _, v in kv_points)}"
        + (f" of {pool_tokens}" if pool_tokens else "")
        + ")",
        kv_max,
    )
    pts = _thin(kv_points, x, plot_w)
    path = []
    for t, v in pts:  # a step line: hold the value until the next change
        vy = kv_top + PANEL_HEIGHT - v / kv_max * PANEL_HEIGHT
        path.append(f"H{x(t):.2f} V{vy:.2f}" if path else f"M{x(t):.2f},{vy:.2f}")
    path.append(f"H{x(t1):.2f}")
    svg.add("path", d=" ".join(path), fill="none", stroke=COLORS["kv"], stroke_width=1.5)
    if pool_tokens:
        py = kv_top + PANEL_HEIGHT - pool_tokens / kv_max * PANEL_HEIGHT
        svg.add(
            "line",
            x1=LEFT,
            x2=LEFT + plot_w,
            y1=f"{py:.2f}",
            y2=f"{py:.2f}",
            stroke=COLORS["pool"],
            stroke_dasharray="4 3",
        )
    # Batch size.
    batch_max = max([s.batch_size for s in tl.steps] + [1])
    _panel(svg, batch_top, f"batch size (prefill orange, decode blue; {len(tl.steps)} passes)", batch_max)
    for phase in ("decode", "prefill"):
        pts = _thin([(s.ts, s.batch_size) for s in tl.steps if s.phase == phase], x, plot_w)
        for t, v in pts:
            vy = batch_top + PANEL_HEIGHT - v / batch_max * PANEL_HEIGHT
            svg.add(
                "line",
                x1=f"{x(t):.2f}",
                x2=f"{x(t):.2f}",
                y1=batch_top + PANEL_HEIGHT,
                y2=f"{vy:.2f}",
                stroke=COLORS[phase],
                stroke_width=1,
            )
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {WIDTH} {height:.0f}">'
    )
    return head + "\n" + "\n".join(svg.parts) + "\n</svg>"


def _panel(svg: _Svg, top: float, label: str, vmax: float) -> None:
    svg.add(
        "rect",
        x=LEFT,
        y=f"{top:.2f}",
        width=WIDTH - LEFT - RIGHT,
        height=PANEL_HEIGHT,
        fill="none",
        stroke="#999999",
    )
    svg.add("text", label, x=LEFT + 4, y=f"{top - 4:.2f}")
    svg.add("text", f"{vmax:g}", x=4, y=f"{top + 10:.2f}")
    svg.add("text", "0", x=4, y=f"{top + PANEL_HEIGHT:.2f}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


# -- PNG -----------------------------------------------------------------------------------------
def render_png(tl: Timeline, out_path: str, pool_tokens: int | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "PNG output needs matplotlib (pip install matplotlib); HTML output (-o FILE.html) needs nothing"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = sorted((r for r in tl.requests.values() if r.queued is not None), key=lambda r: (r.start, r.uid))
    t0 = tl.t0
    fig, (ax_g, ax_kv, ax_b) = plt.subplots(
        3, 1, sharex=True, figsize=(12, 9), gridspec_kw={"height_ratios": [3, 1, 1]}
    )
    for i, r in enumerate(reqs):
        end = r.end if r.end is not None else tl.t1
        admitted = r.admitted if r.admitted is not None else end
        first = r.first_token if r.first_token is not None else end
        for name, a, b in (
            ("waiting", r.queued, admitted),
            ("prefill", admitted, first),
            ("decode", first, end),
        ):
            if b > a:
                ax_g.broken_barh([(a - t0, b - a)], (i, 0.9), color=COLORS[name])
        for a, b in r.preemptions:
            b = b if b is not None else end
            ax_g.broken_barh([(a - t0, b - a)], (i, 0.9), color=COLORS["preempted"], alpha=0.7)
        if r.end_reason == "abort":
            ax_g.plot([end - t0], [i + 0.45], "x", color=COLORS["preempted"])
    ax_g.set_ylabel(f"requests ({len(reqs)})")
    ax_g.invert_yaxis()
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLORS[n]) for n in ("waiting", "prefill", "decode", "preempted")
    ]
    ax_g.legend(handles, ["waiting", "prefill", "decode", "preempted"], loc="upper right", fontsize=8)
    kv = [(t0, 0), *tl.kv_held, (tl.t1, tl.kv_held[-1][1] if tl.kv_held else 0)]
    ax_kv.step([t - t0 for t, _ in kv], [v for _, v in kv], where="post", color=COLORS["kv"])
    if pool_tokens:
        ax_kv.axhline(pool_tokens, color=COLORS["pool"], linestyle="--", linewidth=1)
    ax_kv.set_ylabel("KV slots held")
    for phase in ("decode", "prefill"):
        steps = [s for s in tl.steps if s.phase == phase]
        ax_b.vlines(
            [s.ts - t0 for s in steps],
            0,
            [s.batch_size for s in steps],
            color=COLORS[phase],
            linewidth=1,
            label=phase,
        )
    ax_b.set_ylabel("batch size")
    ax_b.set_xlabel("seconds since the first event")
    ax_b.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
