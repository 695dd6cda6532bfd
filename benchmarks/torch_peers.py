"""The PyTorch peers: Hugging Face's ``LlamaDecoderLayer`` and ``Mamba2Block`` on the CPU.

Here: :class:`TorchLlamaPeer` (attention "eager" or "sdpa", one shared layer) and
:class:`TorchMamba2Peer`, with the peer surface described in :mod:`benchmarks.peers`, and the
map from the benchmark's short weight names to HF's. torch and transformers are imported when
a peer is built, never at import. Not here: checks and timing.
"""

from __future__ import annotations

import copy

import numpy as np

from .workloads import LayerSpec

__all__ = ["TorchLlamaPeer", "TorchMamba2Peer"]


_HF_LLAMA_PREFIX = {
    "q": "self_attn.",
    "k": "self_attn.",
    "v": "self_attn.",
    "o": "self_attn.",
    "gate": "mlp.",
    "up": "mlp.",
    "down": "mlp.",
}


def _transformer_hf_names(w: dict) -> dict:
    """Short Llama weight names -> HF ``LlamaDecoderLayer`` state_dict names."""
    out = {}
    for k, v in w.items():
        head = k.split("_proj")[0]
        out[(_HF_LLAMA_PREFIX[head] + k) if k.endswith("_proj.weight") else k] = v
    return out


def _mamba2_hf_names(w: dict) -> dict:
    """Short Mamba-2 weight names -> HF ``Mamba2Block`` state_dict names."""
    return {("norm.weight" if k == "block_norm.weight" else "mixer." + k): v for k, v in w.items()}


class TorchLlamaPeer:
    """HF ``LlamaDecoderLayer`` (float32, CPU), attention implementation ``impl``.

    The causal mask and RoPE cos/sin (made once per model call by HF, shared by all layers)
    are built in the untimed ``make_*``; everything else the layer does is in the timed call.

    Parameters
    ----------
    shared : dict
        What :meth:`build` returns; the eager and sdpa peers share one layer.
    impl : {"eager", "sdpa"}
        HF ``attn_implementation``, set before every call.
    """

    def __init__(self, shared: dict, impl: str):
        self.name = f"torch_{impl}"
        self.impl = impl
        self.sh = shared  # {"torch", "layer", "rotary", "config", "mask_fn", "cache_cls"}

    @staticmethod
    def build(spec: LayerSpec, weights: dict, max_positions: int) -> dict:
        """Build the HF layer (and its rotary embedding and mask function) for ``spec``.

        Parameters
        ----------
        spec : LayerSpec
            A ``"transformer"`` layer.
        weights : dict of str to ndarray
            Short-name float32 weights, loaded with ``strict=True``.
        max_positions : int
            Positions the layer must support.

        Returns
        -------
        dict
            ``torch``, ``layer``, ``rotary``, ``config``, ``mask_fn``, ``cache_cls``.
        """
        import torch
        from transformers import LlamaConfig
        from transformers.cache_utils import DynamicCache
        from transformers.masking_utils import create_causal_mask
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        rope = dict(spec.rope_scaling) if spec.rope_scaling else {"rope_type": "default"}
        rope["rope_theta"] = spec.rope_theta
        cfg = LlamaConfig(
            hidden_size=spec.d_model,
            intermediate_size=spec.intermediate,
            num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=spec.norm_eps,
            hidden_act="silu",
            num_hidden_layers=1,
            max_position_embeddings=max(
                max_positions, int(rope.get("original_max_position_embeddings", 0)) + 1
            ),
            rope_parameters=rope,
        )
        cfg._attn_implementation = "eager"
        layer = LlamaDecoderLayer(cfg, 0)
        sd = {k: torch.from_numpy(v) for k, v in _transformer_hf_names(weights).items()}
        layer.load_state_dict(sd, strict=True)
        layer.eval()
        return {
            "torch": torch,
            "layer": layer,
            "rotary": LlamaRotaryEmbedding(cfg),
            "config": cfg,
            "mask_fn": create_causal_mask,
            "cache_cls": DynamicCache,
        }

    def _prep(self, xt, pos, attn_2d, cache):
        s = self.sh
        s["config"]._attn_implementation = self.impl
        mask = s["mask_fn"](
            config=s["config"],
            inputs_embeds=xt,
            attention_mask=attn_2d,
            past_key_values=cache,
            position_ids=pos,
        )
        return mask, s["rotary"](xt, pos)

    def _call(self, xt, mask, pos, cos_sin, cache):
        s = self.sh
        s["config"]._attn_implementation = self.impl
        with s["torch"].no_grad():
            out = s["layer"](
                xt,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=cache is not None,
                position_embeddings=cos_sin,
            )
        return out[0] if isinstance(out, tuple) else out

    def make_prefill(self, x, lengths):
        torch = self.sh["torch"]
        b, n, _ = x.shape
        xt = torch.from_numpy(np.ascontiguousarray(x))
        pos = torch.arange(n)[None, :].expand(b, n)
        attn = None
        if lengths is not None:
            attn = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()
        with torch.no_grad():
            mask, cos_sin = self._prep(xt, pos, attn, None)
        return lambda: self._call(xt, mask, pos, cos_sin, None).numpy()

    def prefix_state(self, x_ctx):
        torch = self.sh["torch"]
        cache = self.sh["cache_cls"](config=self.sh["config"])
        xt = torch.from_numpy(np.ascontiguousarray(x_ctx))
        pos = torch.arange(x_ctx.shape[1])[None, :]
        with torch.no_grad():
            mask, cos_sin = self._prep(xt, pos, None, cache)
            y = self._call(xt, mask, pos, cos_sin, cache).numpy()
        return {"cache": cache, "pos": x_ctx.shape[1]}, y

    def tile(self, st, batch: int):
        torch = self.sh["torch"]
        cache = copy.deepcopy(st["cache"])
        cache.reorder_cache(torch.zeros(batch, dtype=torch.long))
        return {"cache": cache, "pos": st["pos"]}

    def clone(self, st):
        return {"cache": copy.deepcopy(st["cache"]), "pos": st["pos"]}

    def make_step(self, st, x_tok):
        torch = self.sh["torch"]
        b = x_tok.shape[0]
        xt = torch.from_numpy(np.ascontiguousarray(x_tok)[:, None, :])
        pos = torch.full((b, 1), st["pos"], dtype=torch.long)
        with torch.no_grad():
            mask, cos_sin = self._prep(xt, pos, None, st["cache"])

        def fn():
            y = self._call(xt, mask, pos, cos_sin, st["cache"])
            st["pos"] += 1
            return y[:, 0].numpy()

        return fn


class TorchMamba2Peer:
    """HF ``Mamba2Block`` (float32, CPU, torch path: chunked SSD scan / selective update).

    Parameters
    ----------
    spec : LayerSpec
        A ``"mamba2"`` layer.
    weights : dict of str to ndarray
        Short-name float32 weights, loaded with ``strict=True``.
    """

    name = "torch_eager"

    def __init__(self, spec: LayerSpec, weights: dict):
        import torch
        from transformers import Mamba2Config
        from transformers.cache_utils import DynamicCache
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Block

        cfg = Mamba2Config(
            hidden_size=spec.d_model,
            expand=spec.expand,
            head_dim=spec.head_dim,
            num_heads=spec.n_heads,
            state_size=spec.d_state,
            n_groups=spec.n_groups,
            conv_kernel=spec.conv_kernel,
            use_bias=False,
            use_conv_bias=True,
            chunk_size=256,
            layer_norm_epsilon=spec.norm_eps,
            num_hidden_layers=1,
            hidden_act="silu",
        )
        block = Mamba2Block(cfg, 0)
        sd = {k: torch.from_numpy(v) for k, v in _mamba2_hf_names(weights).items()}
        block.load_state_dict(sd, strict=True)
        block.eval()
        self.torch, self.block, self.config, self.cache_cls = torch, block, cfg, DynamicCache

    def _call(self, xt, cache=None, attn=None):
        with self.torch.no_grad():
            out = self.block(xt, cache_params=cache, attention_mask=attn)
        return out[0] if isinstance(out, tuple) else out

    def make_prefill(self, x, lengths):
        torch = self.torch
        xt = torch.from_numpy(np.ascontiguousarray(x))
        attn = None
        if lengths is not None:
            attn = (torch.arange(x.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
        return lambda: self._call(xt, None, attn).numpy()

    def prefix_state(self, x_ctx):
        cache = self.cache_cls(config=self.config)
        y = self._call(self.torch.from_numpy(np.ascontiguousarray(x_ctx)), cache).numpy()
        return cache, y

    def tile(self, st, batch: int):
        cache = copy.deepcopy(st)
        cache.reorder_cache(self.torch.zeros(batch, dtype=self.torch.long))
        return cache

    def clone(self, st):
        return copy.deepcopy(st)

    def make_step(self, st, x_tok):
        xt = self.torch.from_numpy(np.ascontiguousarray(x_tok)[:, None, :])
        return lambda: self._call(xt, st)[:, 0].numpy()
