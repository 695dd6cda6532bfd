"""The figure ``bench.png``: tokens/s per case and peer, with the NumPy and bandwidth bounds.

Here: :func:`write_plot` (matplotlib, Agg backend, imported only when plotting; without it the
plot is skipped with a message). Not here: the numbers, which come from
:func:`benchmarks.report.layer_rows` and the whole-model result.
"""

from __future__ import annotations

from .peers import PEER_LABELS, PEERS
from .workloads import CASES, Shapes, case_label

__all__ = ["write_plot"]


def write_plot(rows: list[dict], model: dict | None, sh: Shapes, path: str) -> str:
    """Draw one panel per case (log tokens/s) and one for the whole model; save to ``path``.

    Parameters
    ----------
    rows : list of dict
        :func:`benchmarks.report.layer_rows`.
    model : dict or None
        The whole-model result (its panel is left empty without it).
    sh : Shapes
        The cases' sequence shapes (panel titles).
    path : str
        The PNG file to write.

    Returns
    -------
    str
        ``"wrote <path>"``, or why the plot was skipped (matplotlib not installed).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: bench.png skipped (pip install matplotlib)"
    colors = {
        "exactblocks": "#1f77b4",
        "torch_eager": "#ff7f0e",
        "torch_sdpa": "#2ca02c",
        "mojolearn": "#9467bd",
        "hf_generate": "#2ca02c",
        "llama_cpp": "#8c564b",
    }
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    names = list(dict.fromkeys(r["name"] for r in rows))
    labels = {
        r["name"]: r["workload"].replace(" layer", "\nlayer").replace(", ", "\n") for r in rows
    }
    for ax, case in zip(axes.flat, CASES):
        sub = {r["name"]: r for r in rows if r["case"] == case}
        width = 0.8 / len(PEERS)
        for j, p in enumerate(PEERS):
            xs, ys = [], []
            for i, n in enumerate(names):
                m = sub.get(n, {}).get("peers", {}).get(p)
                if isinstance(m, dict):
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(m["tokens_per_s"])
            if xs:
                ax.bar(xs, ys, width, label=PEER_LABELS[p], color=colors[p])
        for i, n in enumerate(names):  # the ceiling as tokens/s
            r = sub.get(n, {})
            t = r.get("numpy_gemm_s")
            if t:
                ax.hlines(
                    r["tokens"] / t,
                    i - 0.45,
                    i + 0.45,
                    colors="k",
                    linestyles="--",
                    label="NumPy GEMMs alone" if i == 0 else None,
                )
            fl = r.get("bandwidth_time_s")
            if fl:
                ax.hlines(
                    r["tokens"] / fl,
                    i - 0.45,
                    i + 0.45,
                    colors="r",
                    linestyles=":",
                    label="read-bandwidth bound" if i == 0 else None,
                )
        ax.set_xticks(range(len(names)), [labels[n] for n in names], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (higher is better)")
        ax.set_title(case_label(case, sh))
        ax.grid(axis="y", which="both", alpha=0.3)
    handles = {}
    for ax in axes.flat[:4]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    axes.flat[5].axis("off")
    axes.flat[5].legend(
        list(handles.values()),
        list(handles.keys()),
        loc="center",
        fontsize=10,
        title="tokens/s per case (log scale)",
    )
    ax = axes.flat[4]
    sides = (("exactblocks", "exactblocks"), ("hf_generate", "HF generate"))
    sides += (("llama_cpp", "llama.cpp"),)
    if model and any(key in model for key, _ in sides):
        width = 0.8 / len(sides)
        for j, (key, lab) in enumerate(sides):
            m = model.get(key)
            if m:
                ax.bar(
                    [j * width - 0.4 + width / 2, 1 + j * width - 0.4 + width / 2],
                    [m["prefill"]["tokens_per_s"], m["decode"]["tokens_per_s"]],
                    width,
                    label=lab,
                    color=colors[key],
                )
        ax.set_xticks([0, 1], ["prefill", "decode (B=1)"])
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"SmolLM2-135M model ({model['prompt_tokens']}-token prompt)")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    fig.suptitle("exactblocks side by side (same threads for every library)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
