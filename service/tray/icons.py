"""The tray icon's images, drawn with Pillow: one per :class:`~service.tray.state.IconState`.

A filled disc whose colour says the state, with a mark for those a colour alone would
not tell apart for a colour-blind person: a ring for *restarting*, an hourglass-like
pair of bars for *waiting*, pause bars for *paused*, a cross for *failed*, a question
mark's dot for *unknown*, a hollow disc for *offline*. Drawn at 4x and scaled down,
so edges are smooth at tray sizes (16-32 px).
"""

from __future__ import annotations

from PIL import Image, ImageDraw

from service.tray.state import IconState

# RGB of each state: the traffic-light colours desktops use (green ready, amber in
# between, red failed), blue for a pause the user chose, grey for no news.
COLOURS: dict[IconState, tuple[int, int, int]] = {
    IconState.READY: (63, 185, 80),
    IconState.BUSY: (88, 166, 255),
    IconState.RESTARTING: (210, 153, 34),
    IconState.WAITING: (219, 109, 40),
    IconState.PAUSED: (130, 80, 223),
    IconState.FAILED: (248, 81, 73),
    IconState.UNKNOWN: (139, 148, 158),
    IconState.OFFLINE: (110, 118, 129),
}

_WHITE = (255, 255, 255, 255)
_SCALE = 4


def draw_icon(state: IconState, size: int = 64) -> Image.Image:
    """The icon of ``state``: an RGBA image of ``size`` x ``size`` pixels."""
    s = size * _SCALE
    image = Image.new("RGBA", (s, s), (0, 0, 0, 0))
    d = ImageDraw.Draw(image)
    colour = (*COLOURS[state], 255)
    pad = s // 16
    box = (pad, pad, s - pad, s - pad)
    if state is IconState.OFFLINE:
        d.ellipse(box, outline=colour, width=s // 8)
    else:
        d.ellipse(box, fill=colour)
    c, u = s // 2, s // 16  # centre and a unit of the marks
    if state is IconState.RESTARTING:
        d.arc((c - 5 * u, c - 5 * u, c + 5 * u, c + 5 * u), 40, 320, fill=_WHITE, width=2 * u)
    elif state is IconState.WAITING:
        d.rectangle((c - 4 * u, c - 5 * u, c + 4 * u, c - 3 * u), fill=_WHITE)
        d.rectangle((c - 4 * u, c + 3 * u, c + 4 * u, c + 5 * u), fill=_WHITE)
        d.polygon([(c - 3 * u, c - 3 * u), (c + 3 * u, c - 3 * u), (c, c)], fill=_WHITE)
    elif state is IconState.PAUSED:
        d.rectangle((c - 4 * u, c - 5 * u, c - u, c + 5 * u), fill=_WHITE)
        d.rectangle((c + u, c - 5 * u, c + 4 * u, c + 5 * u), fill=_WHITE)
    elif state is IconState.FAILED:
        d.line((c - 4 * u, c - 4 * u, c + 4 * u, c + 4 * u), fill=_WHITE, width=2 * u)
        d.line((c - 4 * u, c + 4 * u, c + 4 * u, c - 4 * u), fill=_WHITE, width=2 * u)
    elif state is IconState.UNKNOWN:
        d.ellipse((c - 2 * u, c - 2 * u, c + 2 * u, c + 2 * u), fill=_WHITE)
    elif state is IconState.BUSY:
        for dx in (-4, 0, 4):
            d.ellipse((c + (dx - 1) * u, c - u, c + (dx + 1) * u, c + u), fill=_WHITE)
    return image.resize((size, size), Image.Resampling.LANCZOS)
