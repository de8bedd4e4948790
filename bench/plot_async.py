#!/usr/bin/env python3
"""Draws bench/async_train's loss-against-tokens file (FILE.loss: lines of
"configuration tokens loss") as an SVG line chart, no plotting library
needed.

    bench/plot_async.py bench/results/async_train.md.loss out.svg [TITLE]
"""
import sys

# The configurations drawn, in this order (DDP on 3 ranks trains the same
# tokens as the 3 async workers; a slower rank does not change its losses).
SHOWN = ["ddp3-slow", "async-slow", "async0"]
COLOURS = {"ddp3-slow": "#1f77b4", "async-slow": "#d62728", "async0": "#2ca02c"}
LABELS = {"ddp3-slow": "DDP, 3 ranks",
          "async-slow": "async, 1 server + 3 workers, one 4x slower",
          "async0": "async, --max-staleness 0 (synchronous)"}


def nice_step(span, ticks=6):
    raw = span / ticks
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 0.1
    while mag > raw:
        mag /= 10
    for m in (1, 2, 2.5, 5, 10):
        if mag * m >= raw:
            return mag * m
    return mag * 10


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    series = {}
    for line in open(sys.argv[1]):
        f = line.split()
        if len(f) == 3 and f[0] in SHOWN:
            series.setdefault(f[0], []).append((float(f[1]), float(f[2])))
    if not series:
        sys.exit("no data in " + sys.argv[1])
    title = sys.argv[3] if len(sys.argv) > 3 else "training loss against tokens"
    xs = [x for s in series.values() for x, _ in s]
    ys = [y for s in series.values() for _, y in s]
    x0, x1 = 0.0, max(xs)
    y0, y1 = min(ys), max(ys)
    ystep = nice_step(y1 - y0)
    y0 = ystep * int(y0 / ystep)
    y1 = ystep * (int(y1 / ystep) + 1)
    xstep = nice_step(x1 - x0)
    W, H, L, R, T, B = 760, 440, 70, 20, 40, 60
    pw, ph = W - L - R, H - T - B

    def px(x):
        return L + (x - x0) / (x1 - x0) * pw

    def py(y):
        return T + (y1 - y) / (y1 - y0) * ph

    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
           'font-family="sans-serif" font-size="12">' % (W, H),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="22" font-size="14">%s</text>' % (L, title)]
    y = y0
    while y <= y1 + 1e-9:
        out.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>' % (L, L + pw, py(y), py(y)))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.2f</text>' % (L - 6, py(y) + 4, y))
        y += ystep
    x = 0.0
    while x <= x1 + 1e-9:
        out.append('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#ddd"/>' % (px(x), px(x), T, T + ph))
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%gk</text>' % (px(x), T + ph + 16, x / 1000))
        x += xstep
    out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>' % (L, T, pw, ph))
    out.append('<text x="%d" y="%d" text-anchor="middle">tokens trained (all workers)</text>' % (L + pw / 2, H - 18))
    out.append('<text x="16" y="%d" transform="rotate(-90 16 %d)" text-anchor="middle">training loss</text>'
               % (T + ph / 2, T + ph / 2))
    ly = T + 12
    for name in SHOWN:
        if name not in series:
            continue
        pts = sorted(series[name])
        colour = COLOURS.get(name, "#000")
        out.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>'
                   % (colour, " ".join("%.1f,%.1f" % (px(a), py(b)) for a, b in pts)))
        out.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"/>'
                   % (L + pw - 300, L + pw - 276, ly - 4, ly - 4, colour))
        out.append('<text x="%d" y="%d">%s</text>' % (L + pw - 270, ly, LABELS.get(name, name)))
        ly += 16
    out.append("</svg>")
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
