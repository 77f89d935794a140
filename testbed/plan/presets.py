"""Named model shapes: ``model: {preset: llama3-70b}`` in a plan, with any key overridden beside it.

Each preset is the ``model`` mapping of a plan (the keys of
:class:`testbed.plan.spec.ModelSpec`), with the published shapes; the
parameter count :func:`testbed.model.costs.param_count` gives for it equals
the published count (:data:`PUBLISHED_PARAMS`, tested exactly; MoE presets' active parameters,
:func:`testbed.model.moe.active_param_count`, equal :data:`PUBLISHED_ACTIVE_PARAMS`):

- ``gpt3-175b``: Brown et al. 2020, "Language Models are Few-Shot Learners",
  Table 2.1 (96 layers, d_model 12288, 96 heads of 128, d_ff 4 x d_model,
  context 2048) with GPT-2's architecture, which GPT-3 keeps (learned
  positions, biases, LayerNorm, GELU, the head tied to the 50257-token
  GPT-2 BPE table): 174,604,259,328 parameters ("175.0B" in the table).
- ``llama3-8b``, ``llama3-70b``: Meta Llama 3 (the ``config.json`` of the
  released checkpoints; Grattafiori et al. 2024, "The Llama 3 Herd of
  Models", Table 3): GQA with 8 K/V heads, SwiGLU, RMSNorm, RoPE with
  theta 500000, no biases, untied 128256-token embeddings, context 8192.
- ``llama3-405b``: Llama 3.1 405B (126 layers, d_model 16384, 128 heads,
  d_ff 53248) at its pre-training context, 8192 tokens, and batch, 2048
  sequences (16M tokens): the Llama 3 paper's sections 3.3.2 and 3.4.1
  and Table 4 (rows of 8,192 and 16,384 GPUs, "Seq. Len. 8,192",
  "Tokens/Batch 16M"; the batch the paper reaches after 2.87T tokens).
- ``llama3-405b-128k``: the same model in its long-context phase (the
  paper's section 3.4.2 and Table 4's last row: 131,072 tokens, 16M tokens
  per batch, so 128 sequences); a phase of its own rather than the default,
  since most of the training (and any question about it) is at 8K. The
  long-context RoPE scaling is not modelled.
- ``mistral-7b``: Mistral 7B v0.1 (Jiang et al. 2023, Table 1): Llama's
  pieces with 32000 tokens, theta 10000, context 8192 and its 4096-token
  sliding window (``sliding_window``; the rolling K/V cache is an inference matter).
- ``gemma-7b``: Gemma 7B (Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and
  Technology", arXiv:2403.08295, Tables 1 and 2): 28 layers, d_model 3072, 16 heads (MHA) of
  ``head_dim`` 256 (so Q is 4096 wide, not d_model), GeGLU MLP of 2 x 24576 ("feedforward hidden
  dims 49152"; modelled as ``swiglu``: the same three matrices and FLOPs, silu for gelu), RMSNorm,
  RoPE, no biases, the head tied to the 256128-token table, context 8192: 786,825,216 embedding and
  7,751,248,896 non-embedding parameters, as Table 2 gives them.
- ``mixtral-8x7b``: Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Sec. 2 / Table 1, and
  the ``config.json`` of ``mistralai/Mixtral-8x7B-v0.1``): Mistral 7B's pieces (32 layers, d_model 4096,
  32 heads, 8 K/V heads, SwiGLU experts of d_ff 14336, 32000 tokens, untied, RMSNorm, no biases), RoPE
  theta 1e6, context 32768, every layer an MoE of 8 experts, top-2: 46,702,792,704 parameters, of which
  12,879,925,248 active per token (the paper's "47B" and "13B active").
- ``deepseek-moe-16b``: DeepSeekMoE 16B (Dai et al. 2024, "DeepSeekMoE: Towards Ultimate Expert
  Specialization in Mixture-of-Experts Language Models", Sec. 5.1 / Appendix, and the ``config.json``
  of ``deepseek-ai/deepseek-moe-16b-base``): 28 layers, d_model 2048, 16 heads (MHA), SwiGLU, RMSNorm,
  RoPE theta 10000, no biases, untied 102400-token embeddings, context 4096; layer 0 dense
  (``intermediate_size`` 10944), layers 1-27 MoE with 64 fine-grained routed experts of 1408 (top-6)
  and 2 shared experts of 1408 (``first_k_dense_replace`` 1, ``n_shared_experts`` 2). The config gives
  16,375,728,128 parameters, 2,828,650,496 active; the paper rounds them to "16.4B" and "2.8B".
- ``gpt-125m`` ... ``gpt-6.7b``: the smaller GPT-3 shapes of Table 2.1 with
  the vocabulary padded to 50304 and untied head; no exact published count
  (the table rounds), so they are not in :data:`PUBLISHED_PARAMS`.
  ``gpt-tiny`` is a 4-layer toy for tests and CPUs.

:data:`DEFAULT_BATCH` is the global batch (sequences) a search or sweep
starts from when none is given: the published pre-training batch where a
source gives one (:data:`SOURCES` says which), else a round size for the
model. :data:`SOURCES` names, per preset, where its shape, context and
batch come from; ``testbed presets`` lists every preset's full model
mapping with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from testbed.errors import InputError, closest

__all__ = ["PRESETS", "PUBLISHED_PARAMS", "PUBLISHED_ACTIVE_PARAMS", "DEFAULT_BATCH", "SOURCES", "preset_names",
           "preset"]

_LLAMA: dict[str, Any] = {"mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False,
                          "tied_embeddings": False}

#: Preset name -> the plan's ``model`` mapping.
PRESETS: Mapping[str, Mapping[str, Any]] = {
    "gpt3-175b": {"layers": 96, "d_model": 12288, "heads": 96, "d_ff": 49152, "seq_len": 2048, "vocab": 50257,
                  "tied_embeddings": True},
    "llama3-8b": {**_LLAMA, "layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8, "d_ff": 14336,
                  "seq_len": 8192, "vocab": 128256, "rope_theta": 500000.0},
    "llama3-70b": {**_LLAMA, "layers": 80, "d_model": 8192, "heads": 64, "kv_heads": 8, "d_ff": 28672,
                   "seq_len": 8192, "vocab": 128256, "rope_theta": 500000.0},
    "llama3-405b": {**_LLAMA, "layers": 126, "d_model": 16384, "heads": 128, "kv_heads": 8, "d_ff": 53248,
                    "seq_len": 8192, "vocab": 128256, "rope_theta": 500000.0},
    "llama3-405b-128k": {**_LLAMA, "layers": 126, "d_model": 16384, "heads": 128, "kv_heads": 8, "d_ff": 53248,
                         "seq_len": 131072, "vocab": 128256, "rope_theta": 500000.0},
    "gemma-7b": {**_LLAMA, "layers": 28, "d_model": 3072, "heads": 16, "head_dim": 256, "d_ff": 24576,
                 "seq_len": 8192, "vocab": 256128, "tied_embeddings": True},
    "mistral-7b": {**_LLAMA, "layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8, "d_ff": 14336,
                   "seq_len": 8192, "vocab": 32000, "rope_theta": 10000.0, "sliding_window": 4096},
    "mixtral-8x7b": {**_LLAMA, "layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8, "d_ff": 14336,
                     "seq_len": 32768, "vocab": 32000, "rope_theta": 1000000.0, "experts": 8, "top_k": 2},
    "deepseek-moe-16b": {**_LLAMA, "layers": 28, "d_model": 2048, "heads": 16, "d_ff": 10944, "seq_len": 4096,
                         "vocab": 102400, "rope_theta": 10000.0, "experts": 64, "top_k": 6, "expert_d_ff": 1408,
                         "shared_experts": 2, "first_dense_layers": 1},
    "gpt-tiny": {"layers": 4, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256},
    "gpt-125m": {"layers": 12, "d_model": 768, "heads": 12, "d_ff": 3072, "seq_len": 2048, "vocab": 50304},
    "gpt-350m": {"layers": 24, "d_model": 1024, "heads": 16, "d_ff": 4096, "seq_len": 2048, "vocab": 50304},
    "gpt-1.3b": {"layers": 24, "d_model": 2048, "heads": 16, "d_ff": 8192, "seq_len": 2048, "vocab": 50304},
    "gpt-2.7b": {"layers": 32, "d_model": 2560, "heads": 32, "d_ff": 10240, "seq_len": 2048, "vocab": 50304},
    "gpt-6.7b": {"layers": 32, "d_model": 4096, "heads": 32, "d_ff": 16384, "seq_len": 2048, "vocab": 50304},
}

#: Global batch (sequences) a search starts from when the user gives none.
DEFAULT_BATCH: Mapping[str, int] = {
    "gpt-tiny": 16, "gpt-125m": 256, "gpt-350m": 256, "gpt-1.3b": 256, "gpt-2.7b": 512, "gpt-6.7b": 512,
    "gpt3-175b": 1536, "llama3-8b": 512, "llama3-70b": 512, "llama3-405b": 2048, "llama3-405b-128k": 128,
    "mistral-7b": 512, "gemma-7b": 512,
    "mixtral-8x7b": 512, "deepseek-moe-16b": 1024,
}

_GPT3 = "Brown et al. 2020, arXiv:2005.14165, Table 2.1 (shape, context 2048)"
_LLAMA3 = "Grattafiori et al. 2024, arXiv:2407.21783, Table 3 (shape)"

#: Preset name -> where its shape, sequence length and default batch come from.
SOURCES: Mapping[str, str] = {
    "gpt3-175b": _GPT3 + "; batch 1536 is a round size (the paper's is 3.2M tokens = 1562.5 sequences)",
    "llama3-8b": _LLAMA3 + ", section 3.3 (pre-training context 8192); batch 512 is a round size",
    "llama3-70b": _LLAMA3 + ", section 3.3 (pre-training context 8192); batch 512 is a round size",
    "llama3-405b": _LLAMA3 + ", sections 3.3.2 and 3.4.1 and Table 4 (pre-training: context 8192, 16M tokens "
                   "= 2048 sequences per batch after the first 2.87T tokens)",
    "llama3-405b-128k": _LLAMA3 + ", section 3.4.2 and Table 4's last row (long-context phase: context 131072, "
                        "16M tokens = 128 sequences per batch)",
    "mistral-7b": "Jiang et al. 2023, arXiv:2310.06825, Table 1 (shape, context 8192, sliding window 4096); batch "
                  "512 is a round size",
    "gemma-7b": "Gemma Team 2024, arXiv:2403.08295, Table 1 (shape: head size 256, vocab 256128, GeGLU; context "
                "8192) and Table 2 (parameters); batch 512 is a round size (the paper gives none)",
    "mixtral-8x7b": "Jiang et al. 2024, arXiv:2401.04088, section 2 / Table 1 (shape, context 32768); batch 512 "
                    "is a round size",
    "deepseek-moe-16b": "Dai et al. 2024, arXiv:2401.06066, section 5.1 (shape, context 4096); batch 1024 is a "
                        "round size",
    "gpt-tiny": "a 4-layer toy for tests and CPUs",
    **{name: _GPT3.replace("2048)", "2048); vocabulary padded to 50304, untied head")
       for name in ("gpt-125m", "gpt-350m", "gpt-1.3b", "gpt-2.7b", "gpt-6.7b")},
}

#: The published parameter counts (Meta's and Mistral's model cards and checkpoints; GPT-3's from
#: Table 2.1's shapes, see the module docstring).
PUBLISHED_PARAMS: Mapping[str, int] = {
    "gpt3-175b": 174_604_259_328,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "llama3-405b-128k": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "gemma-7b": 786_825_216 + 7_751_248_896,   # Gemma paper Table 2: embedding + non-embedding parameters
    "mixtral-8x7b": 46_702_792_704,       # Mixtral-8x7B-v0.1's checkpoint; the paper's "47B"
    "deepseek-moe-16b": 16_375_728_128,   # from deepseek-moe-16b-base's config; the paper's "16.4B"
}

#: Parameters one token uses (the routed experts it is not sent to left out) of the MoE presets.
PUBLISHED_ACTIVE_PARAMS: Mapping[str, int] = {
    "mixtral-8x7b": 12_879_925_248,       # the paper's "13B active parameters"
    "deepseek-moe-16b": 2_828_650_496,    # from the config; the paper's "2.8B"
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: Any) -> dict[str, Any]:
    """A copy of preset ``name``'s model mapping; an unknown name is an error naming ``model.preset``."""
    if not isinstance(name, str) or name not in PRESETS:
        hint = closest(str(name), preset_names())
        raise InputError(f"unknown preset `{name}`" + (f" (did you mean `{hint}`?)" if hint else "")
                         + f"; valid: {', '.join(preset_names())}", field="model.preset")
    return dict(PRESETS[name])
