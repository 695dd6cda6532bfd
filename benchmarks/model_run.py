"""The whole SmolLM2-135M-Instruct model: exactblocks' 30 blocks + head vs HF ``generate``.

Here: :data:`MODEL_PROMPT` and :func:`run_model`. The model is loaded as ``exactblocks demo``
loads it (the public GGUF loader, tokenizer and head of the library); exactblocks' decode is
checked against one forward bit for bit and HF's prompt logits against exactblocks', then
both sides are timed in interleaved rounds (prompt prefill, then greedy decode). Not here:
the single-layer workloads (:mod:`benchmarks.layer_run`).
"""

from __future__ import annotations

import time

import numpy as np

from .checks import Recorder, bits_equal, first_diff
from .timing import MIN_REPEATS, Measurement, median
from .workloads import Shapes

__all__ = ["MODEL_PROMPT", "run_model"]

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


def run_model(sh: Shapes, avail: dict, opts: dict, rec: Recorder) -> dict:
    """SmolLM2-135M-Instruct: exactblocks blocks + NumPy head vs HF ``generate`` (sdpa).

    Parameters
    ----------
    sh : Shapes
        ``sh.model_new_tokens`` greedy tokens are decoded per round.
    avail : dict
        ``avail["torch_error"]`` is None when torch and transformers import (else HF is
        skipped).
    opts : dict
        The run's repeats: ``repeats`` rounds when explicit, else between ``MIN_REPEATS``
        and 5.
    rec : Recorder
        Gets the checks and notes.

    Returns
    -------
    dict
        ``label``, ``prompt``, ``prompt_tokens``, ``new_tokens``, the greedy tokens of both
        sides and how many leading ones agree, and per timed side (``"exactblocks"``,
        ``"hf_generate"``; a side whose check failed is absent) ``{"prefill": ..., "decode":
        ...}`` as :meth:`benchmarks.timing.Measurement.as_dict`.

    Raises
    ------
    FileNotFoundError
        The model file is not found (the demo's ``open_gguf(None)`` lookup).
    ImportError
        gguf or tokenizers is missing.
    """
    from exactblocks.cli import final_logits, pack_head
    from exactblocks.loaders.gguf import build_blocks, hf_state_dict, load_gguf_llama, open_gguf
    from exactblocks.tokenizer import GGUFTokenizer

    out: dict = {"label": "SmolLM2-135M-Instruct model (30 blocks + head)"}
    rec.log("[smollm2-model] loading the GGUF ...")
    reader = open_gguf(None)
    config, layers, top = load_gguf_llama(reader)
    tok = GGUFTokenizer.from_gguf(reader)
    del reader
    ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": MODEL_PROMPT}], add_generation_prompt=True, tokenize=True
        )
    )
    n_new = sh.model_new_tokens
    T = len(ids)
    out.update(prompt_tokens=T, new_tokens=n_new, prompt=MODEL_PROMPT)
    blocks = build_blocks(config, layers, max_positions=T + n_new + 1)
    embed, norm_w, head_w = top["embed_tokens.weight"], top["norm.weight"], top["lm_head.weight"]
    head_packed = pack_head(head_w)  # as the demo: the head on exactblocks' GEMV
    eps = config["rms_norm_eps"]

    def eb_prefill():
        states = [blk.allocate_state(1, T + n_new + 1) for blk in blocks]
        x = embed[np.asarray(ids)][None]
        for blk, st in zip(blocks, states):
            x = blk.forward(x, st)
        token = int(final_logits(x[0, -1:], norm_w, head_packed, eps).argmax())
        return states, x, token

    def eb_decode(states, token, n):
        toks, rows, times = [], [], []
        for _ in range(n):
            toks.append(token)
            t0 = time.perf_counter()
            h = embed[token][None]
            for blk, st in zip(blocks, states):
                h = blk.step(h, st)
            token = int(final_logits(h[0], norm_w, head_packed, eps).argmax())
            times.append(time.perf_counter() - t0)
            rows.append(h[0])
        return toks + [token], rows, times

    rounds: dict = {}  # side -> one timed round: (prefill seconds, decode step seconds)
    # exactblocks: check run (decode == one prefill, bitwise), then timing
    states, x_prompt, first = eb_prefill()
    gen, rows, _ = eb_decode(states, first, n_new)
    fed = ids + gen[:n_new]
    x = embed[np.asarray(fed)][None]
    for blk in blocks:
        x = blk.forward(x)
    decoded = np.concatenate([x_prompt[0]] + rows, axis=0)
    ok = rec.check(
        "smollm2-model",
        "model",
        "exactblocks",
        f"prefill {T} + {n_new} x step through 30 blocks == one forward, bitwise",
        bits_equal(decoded, x[0]),
        "equal" if bits_equal(decoded, x[0]) else first_diff(decoded, x[0]),
    )
    eb_logits = final_logits(x_prompt[0], norm_w, head_packed, eps)
    out["exactblocks_tokens"] = gen

    hf_model = None
    if avail["torch_error"] is None:
        try:
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(
                vocab_size=int(config["vocab_size"]),
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=config["num_attention_heads"],
                num_key_value_heads=config["num_key_value_heads"],
                head_dim=config["head_dim"],
                rms_norm_eps=eps,
                hidden_act="silu",
                max_position_embeddings=config["max_position_embeddings"],
                rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]},
                tie_word_embeddings=bool(config["tie_word_embeddings"]),
                bos_token_id=config["bos_token_id"],
                eos_token_id=config["eos_token_id"],
            )
            hf_model = LlamaForCausalLM(cfg)
            sd = {k: torch.from_numpy(v) for k, v in hf_state_dict(layers, top).items()}
            hf_model.load_state_dict(sd, strict=True)
            hf_model.eval()
            out["hf_attn_implementation"] = hf_model.config._attn_implementation
        except Exception as exc:  # noqa: BLE001
            rec.note(f"smollm2-model: HF LlamaForCausalLM could not be built: {exc!r}")
            hf_model = None
    del layers

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
            "smollm2-model",
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
                    pad_token_id=config["eos_token_id"],
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
        rec.log(f"  model: {same}/{len(gen)} leading greedy tokens identical to HF generate")
        if ok_hf:

            def hf_round():
                _, tp, td = hf_generate(n_new + 1)
                return tp, td

            rounds["hf_generate"] = hf_round
    if ok:

        def eb_round():
            t0 = time.perf_counter()
            states, _, first = eb_prefill()
            tp = time.perf_counter() - t0
            _, _, td = eb_decode(states, first, n_new)
            return tp, td

        rounds["exactblocks"] = eb_round
    # Timed rounds, interleaved: each round runs every side once (prompt prefill, then the
    # greedy decode), so a slow spell of the machine hits both alike.
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
