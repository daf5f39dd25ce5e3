"""Matplotlib for files only (no display): saving a figure where its parents may not exist, or
as an inline PNG."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path) -> Path:
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    pyplot().close(fig)
    return out


def data_uri(fig) -> str:
    """The figure as an inline PNG (`data:image/png;base64,...`), for a self-contained page."""
    import base64
    import io

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    pyplot().close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
