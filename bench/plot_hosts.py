#!/usr/bin/env python3
"""bench/plot_hosts.py - a bar chart (SVG, no plotting library needed) of a
table bench/algos_hosts wrote: busbw per size for each row (build, streams,
algorithm), in place or out of place.

    bench/plot_hosts.py TABLE.md OUT.svg [--form in|out] [--line MBPS:LABEL]
                        [--title TEXT] [--build BUILD]

--line draws a horizontal reference, e.g. the link's measured goodput.
"""
import argparse
import html
import re


def rows_of(path, form, build=None):
    """The table's sizes and its rows (name, busbw per size).  Tables with
    and without the streams column (older runs) both parse."""
    sizes, rows, alg = [], [], None
    for line in open(path, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "build" and "algorithm" in cells:
            alg = cells.index("algorithm")
            sizes = [c.split()[0] for c in cells[alg + 1::2]]
        elif (alg is not None and len(cells) == alg + 1 + 2 * len(sizes)
              and not cells[0].startswith("---") and (build is None or cells[0] == build)):
            vals = cells[alg + 1::2] if form == "out" else cells[alg + 2::2]
            nums = []
            for v in vals:
                m = re.match(r"([0-9.]+)", v)
                nums.append(float(m.group(1)) if m else 0.0)
            streams = cells[1] if alg == 2 else "1"
            name = cells[alg]
            if streams == "ucx":
                name += " (UCX)"
            elif streams != "1":
                name += f" ({streams} streams)"
            rows.append((name, nums))
    return sizes, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("out")
    ap.add_argument("--form", choices=["in", "out"], default="in")
    ap.add_argument("--line", default="")
    ap.add_argument("--title", default="")
    ap.add_argument("--build", default=None, help="only the rows of this build")
    a = ap.parse_args()
    sizes, rows = rows_of(a.table, a.form, a.build)
    if not rows:
        raise SystemExit(f"plot_hosts: no algos_hosts table in {a.table}")
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    w, h, left, bottom, top = 760, 360, 60, 50, 40
    plot_w, plot_h = w - left - 180, h - bottom - top
    line = None
    if a.line:
        v, _, label = a.line.partition(":")
        line = (float(v), label)
    ymax = max([max(n) for _, n in rows] + [line[0] if line else 0]) * 1.15
    group = plot_w / len(sizes)
    bar = group * 0.8 / len(rows)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{html.escape(a.title)}</text>']
    for k in range(6):  # y grid
        y = top + plot_h - plot_h * k / 5
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{ymax * k / 5:.0f}</text>')
    out.append(f'<text x="14" y="{top + plot_h / 2}" transform="rotate(-90 14 {top + plot_h / 2})" '
               f'text-anchor="middle">busbw (MB/s, {a.form} of place)</text>')
    for i, s in enumerate(sizes):
        gx = left + i * group + group * 0.1
        for j, (_, nums) in enumerate(rows):
            bh = plot_h * nums[i] / ymax
            x = gx + j * bar
            out.append(f'<rect x="{x:.1f}" y="{top + plot_h - bh:.1f}" width="{bar * 0.9:.1f}" '
                       f'height="{bh:.1f}" fill="{colors[j % len(colors)]}"/>')
            out.append(f'<text x="{x + bar * 0.45:.1f}" y="{top + plot_h - bh - 3:.1f}" '
                       f'text-anchor="middle" font-size="10">{nums[i]:.0f}</text>')
        out.append(f'<text x="{left + i * group + group / 2:.1f}" y="{top + plot_h + 18}" '
                   f'text-anchor="middle">{html.escape(s)}</text>')
    if line:
        y = top + plot_h - plot_h * line[0] / ymax
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
                   f'stroke="black" stroke-dasharray="5,4"/>')
        out.append(f'<text x="{left + plot_w + 6}" y="{y + 4:.1f}">{html.escape(line[1])}</text>')
    for j, (name, _) in enumerate(rows):
        y = top + 10 + 18 * j
        out.append(f'<rect x="{left + plot_w + 10}" y="{y - 9}" width="12" height="12" '
                   f'fill="{colors[j % len(colors)]}"/>')
        out.append(f'<text x="{left + plot_w + 28}" y="{y + 1}">{html.escape(name)}</text>')
    out.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>')
    out.append("</svg>")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
