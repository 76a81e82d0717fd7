"""Write one benchmark's figures into its own marked section of ``docs/benchmarks.md``.

Each benchmark owns the block between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``;
updating it leaves the rest of the file untouched.
"""

from __future__ import annotations

import os
import re
import statistics

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
HEADER = (
    "# Benchmarks\n\n"
    "Figures measured on the machine named in each section; every section is written by the\n"
    "tool it names, so rerun that tool to refresh it.\n"
)


def update_section(name: str, markdown_text: str, path: str = DOC) -> None:
    """Replace (or append) the ``name`` section of the benchmarks document."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"section name {name!r} must be letters, digits, '.', '_' or '-'")
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown_text.strip()}\n{end}"
    text = HEADER
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def publish(name: str, text: str, out: str, plot=None, image: str | None = None) -> None:
    """Write a benchmark's section into ``out`` and, with ``plot(path)`` and ``image``, its
    chart under ``img/`` beside it; say what was written."""
    out = os.path.abspath(out)
    if plot is not None and image is not None:
        plot(os.path.join(os.path.dirname(out), "img", image))
    update_section(name, text, path=out)
    print(f"wrote the '{name}' section of {out}" + (f" and img/{image}" if image else ""))


def save_figure(fig, path) -> None:
    """Lay out ``fig``, write it to ``path`` as PNG (folders made as needed) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cached_meta(root: str, params: dict) -> dict | None:
    """The ``corpus.json`` under ``root`` when it was built with ``params``, else None (the
    caller rebuilds the corpus)."""
    import json

    meta_path = os.path.join(root, "corpus.json")
    if not os.path.exists(meta_path):
        return None
    with open(meta_path) as f:
        meta = json.load(f)
    return meta if meta.get("params") == params else None


def spread(values, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """'median (min-max)' of ``values / scale``; the value alone when there is one."""
    v = [x / scale for x in values]
    if len(v) == 1:
        return fmt.format(v[0])
    return f"{fmt.format(statistics.median(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"
