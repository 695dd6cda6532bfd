"""One layer workload: checks first, then the timings of every peer, case by case.

Here: :func:`run_layer`. It draws the weights and inputs, checks exactblocks against itself
bit for bit (decode == one forward, ragged rows == rows alone, B=8 rows == rows stepped
alone), checks every other peer against exactblocks (``checks.ROW_RTOL``), then times the
peers that passed, NumPy's matmuls at the same GEMM shapes included, in interleaved rounds.
Not here: the whole model (:mod:`benchmarks.model_run`) and the report.
"""

from __future__ import annotations

import time

import numpy as np

from . import checks
from .checks import Recorder, bits_equal, first_diff, row_rel_err
from .numpy_peer import NumpyPeer
from .peers import build_peers
from .timing import (
    Measurement,
    decode_sampler,
    median,
    prefill_sampler,
    run_decode,
    time_interleaved,
)
from .workloads import CASES, LayerSpec, Shapes, case_tokens, mamba2_weights, transformer_weights

__all__ = ["run_layer"]


def run_layer(
    spec: LayerSpec,
    sh: Shapes,
    avail: dict,
    opts: dict,
    rec: Recorder,
    numpy_peer: NumpyPeer | None = None,
    ceiling: dict | None = None,
) -> dict:
    """Checks, then timings, of one layer workload.

    Parameters
    ----------
    spec : LayerSpec
        The layer.
    sh : Shapes
        The cases' sequence shapes.
    avail : dict
        Which optional peers import (see :func:`benchmarks.peers.build_peers`).
    opts : dict
        The run's repeats (see :func:`benchmarks.timing.n_repeats`).
    rec : Recorder
        Gets every check and note.
    numpy_peer : NumpyPeer or None, default=None
        When given (with ``ceiling``), NumPy's matmuls at the block's GEMM shapes are timed in
        the same rounds.
    ceiling : dict or None, default=None
        ``ceiling["groups"]["<workload>/<case>"]`` gets NumPy's median (``seconds``), best
        pass (``best_seconds``), samples and GFLOP/s.

    Returns
    -------
    dict
        ``{case: {peer: Measurement or "check failed" or "error: <type>"}}``.

    Raises
    ------
    Exception
        Whatever exactblocks raises (any other peer's failure is recorded, not raised).
    """
    rng = np.random.default_rng(1234)
    d, L, C, B8 = spec.d_model, sh.prefill_len, sh.context, sh.decode_batch
    W, K = sh.decode_warm_steps, sh.decode_warm_steps + sh.decode_steps  # K steps per repeat
    lens = np.asarray(sh.ragged_lengths, np.int64)
    weights = (transformer_weights if spec.kind == "transformer" else mamba2_weights)(spec, rng)
    x_pre = rng.standard_normal((1, L, d), dtype=np.float32)
    x_ctx = x_pre if C == L else rng.standard_normal((1, C, d), dtype=np.float32)
    x_rag = rng.standard_normal((len(lens), int(lens.max()), d), dtype=np.float32)
    xs1 = rng.standard_normal((K, 1, d), dtype=np.float32)
    xs8 = rng.standard_normal((K, B8, d), dtype=np.float32)
    xs8[:, 0] = xs1[:, 0]
    max_pos = max(L, C + K) + 8

    rec.log(f"[{spec.name}] building peers ...")
    peers = build_peers(spec, weights, max_pos, avail, rec)
    eb = peers["exactblocks"]
    storage = sorted({f for _, f, _ in eb.blk.weight_storage()})
    rec.note(
        f"{spec.name}: exactblocks stores its matrices as {', '.join(storage)} "
        f"({sum(b for *_, b in eb.blk.weight_storage()) / 2**20:.1f} MiB)"
    )
    res: dict = {c: {} for c in CASES}
    name = spec.name

    # ---- exactblocks: the reference outputs, checked bit for bit against itself
    t0 = time.perf_counter()
    y_pre = eb.make_prefill(x_pre, None)()
    t_pre = time.perf_counter() - t0
    st1, y_ctx = eb.prefix_state(x_ctx)
    snap1 = eb.clone(st1)
    y_dec1, dec_times, _ = run_decode(eb, snap1, xs1)
    x_full = np.concatenate([x_ctx, xs1[:, 0][None]], axis=1)
    y_full = eb.make_prefill(x_full, None)()
    ok_dec = bits_equal(y_full[:, :C], y_ctx) and bits_equal(y_full[0, C:], y_dec1[:, 0])
    rec.check(
        name,
        "decode_b1",
        "exactblocks",
        f"prefill {C} + {K} x step == one forward over {C + K} tokens, bitwise",
        ok_dec,
        "equal" if ok_dec else first_diff(np.concatenate([y_ctx[0], y_dec1[:, 0]]), y_full[0]),
    )
    ok_pre = True
    if C == L:
        ok_pre = rec.check(
            name,
            "prefill_b1",
            "exactblocks",
            "forward without state == forward with state, bitwise",
            bits_equal(y_pre, y_ctx),
            "equal" if bits_equal(y_pre, y_ctx) else first_diff(y_pre, y_ctx),
        )
    t0 = time.perf_counter()
    y_rag = eb.make_prefill(x_rag, lens)()
    t_rag = time.perf_counter() - t0
    bad = []
    for b, n in enumerate(lens.tolist()):
        alone = eb.make_prefill(np.ascontiguousarray(x_rag[b : b + 1, :n]), None)()
        if not bits_equal(y_rag[b : b + 1, :n], alone):
            bad.append(f"row {b}: {first_diff(y_rag[b : b + 1, :n], alone)}")
        if not bits_equal(y_rag[b, n:], np.zeros_like(y_rag[b, n:])):
            bad.append(f"row {b}: padding is not +0.0")
    ok_rag = rec.check(
        name,
        "prefill_ragged",
        "exactblocks",
        "each ragged row == the row alone, padding +0.0, bitwise",
        not bad,
        "; ".join(bad) or "equal",
    )
    snap8 = eb.tile(snap1, B8)
    y_dec8, _, _ = run_decode(eb, snap8, xs8)
    bad = []
    for b in range(B8):
        alone, _, _ = run_decode(eb, snap1, xs8[:1, b : b + 1])
        if not bits_equal(y_dec8[0, b], alone[0, 0]):
            bad.append(f"row {b}: {first_diff(y_dec8[0, b], alone[0, 0])}")
    ok_dec8 = rec.check(
        name,
        "decode_b8",
        "exactblocks",
        f"each row of a B={B8} step == that row stepped alone, bitwise",
        not bad,
        "; ".join(bad) or "equal",
    )
    ref = {"prefill_b1": y_pre, "prefill_ragged": y_rag, "decode_b1": y_dec1, "decode_b8": y_dec8}
    warm_eb = {"prefill_b1": t_pre, "prefill_ragged": t_rag, "decode_b1": median(dec_times)}

    def agree(case, peer, got) -> bool:
        want = ref[case]
        if case == "prefill_ragged":
            got = np.concatenate([got[b, :n] for b, n in enumerate(lens.tolist())])
            want = np.concatenate([want[b, :n] for b, n in enumerate(lens.tolist())])
        err = row_rel_err(got, want)
        return rec.check(
            name,
            case,
            peer,
            f"vs exactblocks, per-row rel. error <= {checks.ROW_RTOL:g}",
            err <= checks.ROW_RTOL,
            f"max {err:.2e}",
        )

    # ---- checks and warm-up, peer by peer; then the timed samples of each case, interleaved
    # across peers round by round (a slow spell of a shared machine then hits every peer
    # alike, so the ratios stay meaningful).
    jobs: dict = {c: {} for c in CASES}  # case -> peer -> (sample function, warm s, tokens)
    for pname, peer in peers.items():
        rec.log(f"[{name}] {pname} ...")
        try:
            # prefill B=1 and ragged
            for case, xc, lc, ok_eb in (
                ("prefill_b1", x_pre, None, ok_pre),
                ("prefill_ragged", x_rag, lens, ok_rag),
            ):
                fn = (eb if pname == "exactblocks" else peer).make_prefill(xc, lc)
                if pname == "exactblocks":
                    t_w, ok = warm_eb[case], ok_eb
                else:
                    t0 = time.perf_counter()
                    got = fn()
                    t_w = time.perf_counter() - t0
                    ok = agree(case, pname, got)
                if ok:
                    jobs[case][pname] = (prefill_sampler(fn), t_w, case_tokens(case, sh))
                else:
                    res[case][pname] = "check failed"
            # decode B=1 and B=8 from the same 512-token prefix
            if pname == "exactblocks":
                p_snap1, p_snap8 = snap1, snap8
                t_w, ok1, ok8 = warm_eb["decode_b1"], ok_dec, ok_dec8
                _, times8, _ = run_decode(eb, snap8, xs8[:1])
                t_w8 = times8[0]
            else:
                p_st1, _ = peer.prefix_state(x_ctx)
                p_snap1 = peer.clone(p_st1)
                p_snap8 = peer.tile(p_snap1, B8)
                got1, times1, _ = run_decode(peer, p_snap1, xs1)
                got8, times8, _ = run_decode(peer, p_snap8, xs8)
                t_w, t_w8 = median(times1), median(times8)
                ok1 = agree("decode_b1", pname, got1)
                ok8 = agree("decode_b8", pname, got8)
            for case, ok_c, snap_c, xs_c, tw_c in (
                ("decode_b1", ok1, p_snap1, xs1, t_w),
                ("decode_b8", ok8, p_snap8, xs8, t_w8),
            ):
                if ok_c:
                    jobs[case][pname] = (
                        decode_sampler(peer, snap_c, xs_c, W),
                        tw_c * xs_c.shape[0],
                        xs_c.shape[1],
                    )
                else:
                    res[case][pname] = "check failed"
        except Exception as exc:  # noqa: BLE001 - one broken peer must not end the run
            if pname == "exactblocks":
                raise
            rec.check(name, "-", pname, "runs", False, repr(exc))
            for c in CASES:
                jobs[c].pop(pname, None)
                res[c].setdefault(pname, f"error: {type(exc).__name__}")
    gemm_shapes = spec.gemm_shapes()
    if numpy_peer is not None and ceiling is not None:
        try:
            warm = numpy_peer.request(
                cmd="prepare",
                groups={c: {"m": case_tokens(c, sh), "shapes": gemm_shapes} for c in CASES},
            )["warm"]
            time.sleep(numpy_peer.IDLE_AFTER_S)  # its BLAS threads go idle before the rounds
            for c in CASES:
                jobs[c][numpy_peer.name] = (numpy_peer.sampler(c), warm[c], case_tokens(c, sh))
        except RuntimeError as exc:
            rec.note(f"{name}: NumPy matmuls not measured: {exc}")
    for case in CASES:
        rec.log(f"[{name}] timing {case}, peers interleaved ...")
        for pname, m in time_interleaved(jobs[case], opts, rec, name, case).items():
            if pname != NumpyPeer.name:
                res[case][pname] = m
            elif isinstance(m, Measurement):
                flops = 2.0 * m.tokens * sum(n * k for _, n, k in gemm_shapes)
                ceiling["groups"][f"{name}/{case}"] = {
                    "m": m.tokens,
                    "seconds": m.seconds,
                    "best_seconds": min(m.samples),
                    "samples": m.samples,
                    "gflops": flops / m.seconds / 1e9,
                }
    for c in CASES:
        for pname, m in res[c].items():
            if isinstance(m, Measurement):
                rec.log(
                    f"  {name} {c} {pname}: {1e3 * m.seconds:.3f} ms "
                    f"({m.tokens_per_s:.1f} tok/s, cpu {m.cpu_util:.2f})"
                )
    return res
