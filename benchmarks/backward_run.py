"""The Mamba-2 backward row: ``Mamba2BlockInference.backward`` vs torch autograd of HF's block.

Here: :func:`run_mamba2_backward` and :func:`backward_table`. On the ``mamba2-layer`` workload
(B = 1, L = the prefill length) it checks exactblocks' backward against itself (two calls, bit
for bit) and against torch autograd of HF ``Mamba2Block`` (torch path, float32: every gradient
within ``GRAD_RTOL`` of the largest entry of its tensor), then times, interleaved round by
round at the same threads: exactblocks ``backward`` (which recomputes the forward), exactblocks
``forward``, and torch's forward + ``backward()`` (autograd needs its forward; that is the
work a user's gradient call costs there).
"""

from __future__ import annotations

import time

import numpy as np

from .checks import Recorder, bits_equal
from .timing import Measurement, prefill_sampler, time_interleaved
from .torch_peers import TorchMamba2Peer, _mamba2_hf_names
from .workloads import LayerSpec, Shapes, mamba2_weights

__all__ = ["GRAD_RTOL", "backward_table", "run_mamba2_backward"]

GRAD_RTOL = 1e-3  # float32 vs float32: both off float64 by ~1e-6 at these sizes


def run_mamba2_backward(spec: LayerSpec, sh: Shapes, avail: dict, opts: dict, rec: Recorder):
    """Checks, then timings, of the backward of one Mamba-2 layer at B = 1.

    Parameters
    ----------
    spec : LayerSpec
        A ``"mamba2"`` layer.
    sh : Shapes
        ``prefill_len`` is the sequence length.
    avail : dict
        ``avail["torch_error"]`` is None when torch and transformers import.
    opts : dict
        The run's repeats (see :func:`benchmarks.timing.n_repeats`).
    rec : Recorder
        Gets every check.

    Returns
    -------
    dict
        ``{peer: Measurement or "check failed"}`` for ``exactblocks_backward``,
        ``exactblocks_forward`` and ``torch_autograd``, plus ``"L"``.
    """
    import exactblocks

    rng = np.random.default_rng(4321)
    L, d, name = sh.prefill_len, spec.d_model, spec.name
    weights = mamba2_weights(spec, rng)
    blk = exactblocks.Mamba2BlockInference(weights, norm_eps=spec.norm_eps)
    x = rng.standard_normal((1, L, d), dtype=np.float32)
    gy = rng.standard_normal((1, L, d), dtype=np.float32)
    t0 = time.perf_counter()
    g = blk.backward(x, gy)
    t_bw = time.perf_counter() - t0
    again = blk.backward(x, gy)
    same = all(bits_equal(g[k], again[k]) for k in g)
    rec.check(name, "backward_b1", "exactblocks_backward", "two calls, bitwise", same, "equal")
    t0 = time.perf_counter()
    blk.forward(x)
    t_fw = time.perf_counter() - t0
    jobs = {
        "exactblocks_backward": (prefill_sampler(lambda: blk.backward(x, gy)), t_bw, L),
        "exactblocks_forward": (prefill_sampler(lambda: blk.forward(x)), t_fw, L),
    }
    res: dict = {"L": L}
    if avail.get("torch_error") is None:
        peer = TorchMamba2Peer(spec, weights)
        torch, block = peer.torch, peer.block
        xt = torch.from_numpy(x).requires_grad_(True)
        gt = torch.from_numpy(gy)

        def torch_grad():
            block.zero_grad(set_to_none=True)
            xt.grad = None
            out = block(xt)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(gt)
            return xt.grad

        t0 = time.perf_counter()
        torch_grad()
        t_t = time.perf_counter() - t0
        tg = {"x": xt.grad.numpy()}
        for n, p in block.named_parameters():
            tg[n] = p.grad.numpy()
        hf = _mamba2_hf_names({k: g[k] for k in g if k != "x"})
        hf["x"] = g["x"]
        worst = max(
            float(np.abs(hf[k] - tg[k]).max()) / max(float(np.abs(tg[k]).max()), 1e-30) for k in tg
        )
        ok = set(hf) == set(tg) and worst <= GRAD_RTOL
        rec.check(
            name,
            "backward_b1",
            "torch_autograd",
            f"vs exactblocks, every gradient within {GRAD_RTOL:g} of its largest entry",
            ok,
            f"max {worst:.2e}",
        )
        if ok:
            jobs["torch_autograd"] = (prefill_sampler(torch_grad), t_t, L)
        else:
            res["torch_autograd"] = "check failed"
    rec.log(f"[{name}] timing backward_b1, peers interleaved ...")
    res.update(time_interleaved(jobs, opts, rec, name, "backward_b1"))
    for p, m in res.items():
        if isinstance(m, Measurement):
            rec.log(f"  {name} backward_b1 {p}: {1e3 * m.seconds:.1f} ms")
    return res


def backward_table(res: dict, label: str) -> str:
    """The markdown table of :func:`run_mamba2_backward`'s result.

    Parameters
    ----------
    res : dict
        Its result.
    label : str
        The layer's label.

    Returns
    -------
    str
        One row: exactblocks backward ms, forward ms, backward / forward, torch autograd ms
        and torch / exactblocks (targets: >= 2x torch, backward <= 3x own forward).
    """

    def ms(k):
        m = res.get(k)
        return 1e3 * m.seconds if isinstance(m, Measurement) else None

    bw, fw, tt = ms("exactblocks_backward"), ms("exactblocks_forward"), ms("torch_autograd")
    cell = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    ratio = None if bw is None or fw is None else bw / fw
    vs = None if bw is None or tt is None else tt / bw
    torch_cell = res.get("torch_autograd")
    torch_cell = cell(tt) if tt is not None else (torch_cell or "not available")
    return "\n".join(
        [
            f"### Backward: {label}, B=1, L={res['L']}",
            "",
            "| exactblocks backward ms | exactblocks forward ms | backward / forward "
            "(target <= 3) | torch autograd fwd+bwd ms | vs torch (target >= 2) |",
            "|---:|---:|---:|---:|---:|",
            f"| {cell(bw)} | {cell(fw)} | {cell(ratio, '{:.2f}')} | {torch_cell} | "
            f"{cell(vs, '{:.2f}x')} |",
            "",
            "exactblocks' backward recomputes its forward; torch's time is its forward with "
            "autograd recording plus `backward()`, the same threads.",
        ]
    )
