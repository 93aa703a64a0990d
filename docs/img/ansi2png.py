"""Render a terminal capture (`tmux capture-pane -e -p`, ANSI colours) to PNG, for the README's
screenshot. Docs tooling only: needs Pillow (`pip install '.[bench]'` brings it) and DejaVu Sans Mono.
    python docs/img/ansi2png.py capture.ansi out.png"""
import sys

from PIL import Image, ImageDraw, ImageFont
from rich.text import Text

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"
BOLD = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono-Bold.ttf"
BG, FG, SIZE = (24, 24, 28), (220, 220, 220), 15


def main(src: str, dst: str) -> None:
    lines = [Text.from_ansi(line) for line in open(src, encoding="utf-8").read().rstrip("\n").split("\n")]
    font, bold = ImageFont.truetype(FONT, SIZE), ImageFont.truetype(BOLD, SIZE)
    cw, ch = font.getbbox("M")[2], int(SIZE * 1.35)
    width = max(len(t.plain) for t in lines)
    img = Image.new("RGB", (cw * width + 24, ch * len(lines) + 24), BG)
    draw = ImageDraw.Draw(img)
    for row, text in enumerate(lines):
        styles = [None] * len(text.plain)
        for span in text.spans:
            for i in range(span.start, min(span.end, len(styles))):
                styles[i] = span.style
        for col, char in enumerate(text.plain):
            st = styles[col]
            color = FG
            if st is not None and not isinstance(st, str) and st.color is not None:
                color = st.color.get_truecolor()
                if st.dim:
                    color = tuple(int(c * 0.6) for c in color)
            elif st is not None and not isinstance(st, str) and st.dim:
                color = (140, 140, 140)
            f = bold if st is not None and not isinstance(st, str) and st.bold else font
            draw.text((12 + col * cw, 12 + row * ch), char, font=f, fill=tuple(color))
    img.save(dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
