"""What bench/*.py share on the host: where and how they write their JSON, matplotlib for their plots,
and the ``--tokens`` list."""
from __future__ import annotations

import json
import os


def default_json(name: str) -> str:
    """``$OUT/name`` (the device tool's output folder) or ``bench/results/name``."""
    return os.path.join(os.environ.get("OUT", "bench/results"), name)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def add_output_args(parser, json_name: str) -> None:
    """A bench's ``--json`` (default ``default_json(json_name)``) and ``--png`` flags."""
    parser.add_argument("--json", default=default_json(json_name))
    parser.add_argument("--png", default=None, help="default: the JSON path with .png")


def png_path(args) -> str:
    """``--png``, or the JSON path with .png."""
    return args.png or os.path.splitext(args.json)[0] + ".png"


def save_figure(fig, title: str, path: str) -> None:
    """The plot's title, layout and PNG file."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def pyplot():
    """``matplotlib.pyplot`` drawing to files (the Agg backend: no display on the device machine), or
    None, said on stdout, where matplotlib is not installed: a bench never stops for its plot."""
    try:
        import matplotlib  # noqa: PLC0415 (optional dependency: the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed (pip install 'cute_moe[bench]'): no plot written")
        return None
    return plt


def parse_tokens(arg: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """``--tokens 1,64,4096`` as ints; ``default`` when the flag is not given."""
    if not arg:
        return default
    try:
        vals = tuple(int(v) for v in arg.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"--tokens must be comma-separated ints, got {arg!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise SystemExit(f"--tokens must be positive ints, got {arg!r}")
    return vals
