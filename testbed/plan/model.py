"""The model of a plan: a decoder-only transformer's shape and family options.

:class:`ModelSpec` is the ``model:`` section of a plan (testbed.plan.spec
re-exports it): GPT-2's architecture by default, the Llama family's pieces
(GQA, SwiGLU, RMSNorm, RoPE, untied embeddings, padded vocab), flash
attention, and mixture-of-experts layers (``experts`` > 0). Validated on
construction; the :class:`~testbed.plan.spec.Plan` checks it against the mesh.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum

from testbed.errors import InputError

__all__ = ["Mlp", "Norm", "Position", "Attention", "ModelSpec", "FLASH_BLOCK", "VOCAB_PAD_BASE", "positive",
           "window_rows"]


def window_rows(seq: int, block: int, window: int | None) -> int:
    """Query rows that can see one K/V block of ``block`` keys under a sliding ``window`` of N keys (query ``i``
    sees keys ``i - N < j <= i``): ``block + ceil((N - 1) / block) x block``, at most ``seq``; ``seq`` without a
    window. The blockwise kernel (``testbed/runner/attention.py``) scores each block against these rows only."""
    return seq if window is None else min(seq, block + -(-(window - 1) // block) * block)


@functools.lru_cache(maxsize=256)  # read per plan a search bounds (tens of thousands)
def _largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` not above ``cap`` (``n`` itself up to ``cap``)."""
    return max(b for b in range(1, min(n, cap) + 1) if n % b == 0)


def positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"must be a positive whole number, got {value!r}", field=name)

class Mlp(StrEnum):
    """The MLP: GPT's ``gelu(x W1) W2``, or Llama's ``(silu(x W1) * x W3) W2`` (three matrices)."""

    GELU = "gelu"
    SWIGLU = "swiglu"


class Norm(StrEnum):
    """LayerNorm (scale and, with biases, a bias), or RMSNorm (scale only)."""

    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class Position(StrEnum):
    """A learned position table, or rotary embeddings of Q and K (no parameters)."""

    LEARNED = "learned"
    ROPE = "rope"


class Attention(StrEnum):
    """Dense attention (the ``seq x seq`` scores materialised), or blockwise "flash" attention (FlashAttention-2:
    online softmax over K/V blocks, the backward recomputes the block scores; no ``seq x seq`` buffer)."""

    PLAIN = "plain"
    FLASH = "flash"


#: The largest K/V block of flash attention (FlashAttention-2's typical tile); see :attr:`ModelSpec.flash_block`.
FLASH_BLOCK = 128


#: Megatron's ``make-vocab-size-divisible-by``: an indivisible vocab is padded to a multiple of this x tensor.
VOCAB_PAD_BASE = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer: embedding, ``layers`` pre-norm blocks, final norm, head.

    The defaults are GPT-2's architecture (MHA, GELU MLP, LayerNorm, learned
    positions, biases). ``kv_heads`` < ``heads`` is grouped-query attention
    (``kv_heads`` 1: multi-query); ``mlp``, ``norm``, ``position`` and
    ``bias`` choose the Llama family's pieces; ``attention`` plain or flash
    (``attention_block``: flash's K/V block, default :attr:`flash_block`'s rule). ``dropout`` is a rate the
    memory model counts masks for (the runner trains at rate 0). ``head_dim`` sets one head's width apart
    from ``d_model / heads`` (:attr:`head_size`, :attr:`q_dim`), ``parallel_block`` is PaLM's block (one
    norm; attention and MLP added to the residual together), ``sliding_window`` local attention
    (:attr:`score_rows`: the query rows each K/V block is scored against).

    ``vocab`` is the tokenizer's vocabulary; the token table and head have
    :attr:`padded_vocab` rows. ``pad_vocab_to`` None is the automatic rule
    (:meth:`vocab_multiple_for`): pad only when the tensor degree does not
    divide ``vocab``, then to a multiple of ``128 x tensor`` (Megatron);
    a number pads to a multiple of it (1: never). :class:`Plan` resolves
    the rule for its mesh into ``vocab_multiple``; a ModelSpec on its own
    has ``vocab_multiple`` = ``pad_vocab_to`` or 1.
    """

    kind: str = "gpt"
    layers: int
    d_model: int
    heads: int
    d_ff: int
    seq_len: int
    vocab: int
    tied_embeddings: bool = False
    kv_heads: int | None = None
    mlp: Mlp = Mlp.GELU
    norm: Norm = Norm.LAYERNORM
    position: Position = Position.LEARNED
    bias: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    attention: Attention = Attention.PLAIN
    attention_block: int | None = None
    pad_vocab_to: int | None = None
    vocab_multiple: int = 0
    #: Mixture of experts (0: a dense model). Which layers are MoE: :meth:`is_moe_layer`.
    experts: int = 0
    top_k: int = 2
    #: Hidden width of each routed (and shared) expert; None is ``d_ff`` (fine-grained experts set it smaller).
    expert_d_ff: int | None = None
    #: Always-active experts of width ``expert_d_ff`` beside the routed ones (DeepSeekMoE).
    shared_experts: int = 0
    #: From ``first_dense_layers`` on, every ``moe_every``-th layer is MoE (1: all of them).
    moe_every: int = 1
    first_dense_layers: int = 0
    #: Tokens each expert takes per routing group, as a multiple of the even share; None is dropless.
    capacity_factor: float | None = None
    #: Coefficient of the Switch-Transformer load-balancing loss added to the training loss.
    router_aux_loss: float = 0.01
    #: Width of one attention head; None is ``d_model / heads`` (PaLM, Gemma: set apart from it). Read it
    #: resolved as :attr:`head_size`.
    head_dim: int | None = None
    #: PaLM's and GPT-J's parallel block: ``x + attn(norm(x)) + mlp(norm(x))``, one norm per layer (no ``ln2``).
    parallel_block: bool = False
    #: Local attention: query ``i`` sees keys ``i - N < j <= i`` (Mistral's and Gemma 2's ``sliding_window``);
    #: None is full causal attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind != "gpt":
            raise InputError(f"unknown model kind `{self.kind}`; valid: gpt", field="model.kind")
        for name in ("layers", "d_model", "heads", "d_ff", "seq_len", "vocab"):
            positive(getattr(self, name), f"model.{name}")
        self._check_head_dim()
        if not isinstance(self.parallel_block, bool):
            raise InputError(f"must be true or false, got {self.parallel_block!r}", field="model.parallel_block")
        if self.parallel_block and self.experts:
            raise InputError("a parallel block with mixture-of-experts layers is not supported (the MoE block reads "
                             "the second norm's output); use parallel_block: false or experts: 0",
                             field="model.parallel_block")
        if self.sliding_window is not None:
            positive(self.sliding_window, "model.sliding_window")
        if self.kv_heads is not None:
            positive(self.kv_heads, "model.kv_heads")
            if self.heads % self.kv_heads:
                raise InputError(f"heads {self.heads} must be divisible by kv_heads {self.kv_heads}",
                                 field="model.kv_heads")
            if self.kv_heads == self.heads:  # multi-head attention: stored as unset, so `replace(heads=)` keeps MHA
                object.__setattr__(self, "kv_heads", None)
        for name, enum in (("mlp", Mlp), ("norm", Norm), ("position", Position), ("attention", Attention)):
            value = getattr(self, name)
            if value not in {e.value for e in enum}:
                raise InputError(f"unknown {name} `{value}`; valid: {', '.join(e.value for e in enum)}",
                                 field=f"model.{name}")
            object.__setattr__(self, name, enum(value))
        if not isinstance(self.dropout, (int, float)) or isinstance(self.dropout, bool) or not 0 <= self.dropout < 1:
            raise InputError(f"must be in [0, 1), got {self.dropout!r}", field="model.dropout")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool) or not self.rope_theta > 0:
            raise InputError(f"must be positive, got {self.rope_theta!r}", field="model.rope_theta")
        if self.position is Position.ROPE and self.head_size % 2:
            raise InputError(f"rope needs an even head_dim, got {self.head_size}"
                             + ("" if self.head_dim else " (d_model / heads)"), field="model.position")
        if self.attention_block is not None:
            positive(self.attention_block, "model.attention_block")
            if self.seq_len % self.attention_block:
                raise InputError(f"must divide seq_len {self.seq_len} (flash attention's K/V blocks tile the "
                                 f"sequence), got {self.attention_block}", field="model.attention_block")
        if self.pad_vocab_to is not None:
            positive(self.pad_vocab_to, "model.pad_vocab_to")
            object.__setattr__(self, "vocab_multiple", self.pad_vocab_to)
        elif not self.vocab_multiple:
            object.__setattr__(self, "vocab_multiple", 1)
        positive(self.vocab_multiple, "model.vocab_multiple")
        self._check_moe()

    def _check_head_dim(self) -> None:
        """``head_dim`` unset needs ``heads`` to divide ``d_model``; set, any positive width (stored unset when it
        equals ``d_model / heads``, so ``replace(d_model=)`` of a default model keeps the default rule)."""
        if self.head_dim is None:
            if self.d_model % self.heads:
                raise InputError(f"d_model {self.d_model} must be divisible by heads {self.heads} (or set "
                                 "model.head_dim, the width of one head)", field="model.heads")
            return
        positive(self.head_dim, "model.head_dim")
        if self.head_dim * self.heads == self.d_model:
            object.__setattr__(self, "head_dim", None)

    def _check_moe(self) -> None:
        if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 0:
            raise InputError(f"must be 0 (a dense model) or a positive whole number, got {self.experts!r}",
                             field="model.experts")
        if not self.experts:
            moe_only = {"shared_experts": 0, "first_dense_layers": 0, "moe_every": 1, "capacity_factor": None,
                        "expert_d_ff": None}
            for name, default in moe_only.items():
                if getattr(self, name) != default:
                    raise InputError(f"`{name}` configures mixture-of-experts layers, which need model.experts > 0; "
                                     "set experts (e.g. 8) or drop the key", field=f"model.{name}")
            return
        positive(self.top_k, "model.top_k")
        if self.top_k > self.experts:
            raise InputError(f"top_k {self.top_k} must be at most experts {self.experts}", field="model.top_k")
        if self.expert_d_ff is not None:
            positive(self.expert_d_ff, "model.expert_d_ff")
        positive(self.moe_every, "model.moe_every")
        for name in ("shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"must be a whole number >= 0, got {value!r}", field=f"model.{name}")
        if self.first_dense_layers >= self.layers:
            raise InputError(f"first_dense_layers {self.first_dense_layers} leaves no MoE layer among {self.layers} "
                             "layers; use fewer, or experts: 0 for a dense model", field="model.first_dense_layers")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf <= 1000):
            raise InputError(f"must be a number in (0, 1000] (or null: dropless; a factor above the expert count "
                             f"already holds every token), got {cf!r}", field="model.capacity_factor")
        aux = self.router_aux_loss
        if isinstance(aux, bool) or not isinstance(aux, (int, float)) or not 0 <= aux <= 1000:
            raise InputError(f"must be a number in [0, 1000], got {aux!r}", field="model.router_aux_loss")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has a mixture-of-experts MLP: the one rule both interpreters read."""
        if not self.experts or layer < self.first_dense_layers:
            return False
        return (layer - self.first_dense_layers) % self.moe_every == self.moe_every - 1

    @property
    def expert_width(self) -> int:
        """Hidden width of one expert: ``expert_d_ff`` or ``d_ff``."""
        return self.d_ff if self.expert_d_ff is None else self.expert_d_ff

    @property
    def head_size(self) -> int:
        """Width of one attention head: ``head_dim``, or ``d_model / heads`` when unset."""
        return self.d_model // self.heads if self.head_dim is None else self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of Q and of the attention output: ``heads x head_size`` (``d_model`` unless ``head_dim`` is set)."""
        return self.heads * self.head_size

    @property
    def score_rows(self) -> int:
        """Query rows each K/V block of attention is scored against (both interpreters read it): ``seq_len``,
        but with a ``sliding_window`` under flash attention only the rows that can see the block, a window
        of ``block + ceil((N - 1) / block) x block`` rows (``testbed/runner/attention.py`` skips the others;
        plain attention scores the whole ``seq x seq`` matrix and masks)."""
        flash = self.attention is Attention.FLASH
        return window_rows(self.seq_len, self.flash_block, self.sliding_window if flash else None)

    @property
    def flash_block(self) -> int:
        """Flash attention's K/V block (both interpreters read it): ``attention_block``, or the largest divisor
        of ``seq_len`` not above :data:`FLASH_BLOCK` (``seq_len`` itself up to 128)."""
        if self.attention_block is not None:
            return self.attention_block
        return _largest_divisor(self.seq_len, FLASH_BLOCK)

    @property
    def num_kv_heads(self) -> int:
        """K/V heads: ``kv_heads``, or ``heads`` when unset (multi-head attention; ``kv_heads`` equal to
        ``heads`` is stored unset)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): ``kv_heads x head_size`` (:attr:`q_dim` without GQA)."""
        return self.num_kv_heads * self.head_size

    @property
    def grouped(self) -> bool:
        """Grouped-query (or multi-query) attention: fewer K/V heads than query heads."""
        return self.num_kv_heads != self.heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the token table and the head: ``vocab`` rounded up to ``vocab_multiple``."""
        return -(-self.vocab // self.vocab_multiple) * self.vocab_multiple

    def vocab_multiple_for(self, tensor: int) -> int:
        """The padding multiple at tensor degree ``tensor`` (``pad_vocab_to``, or the automatic rule)."""
        if self.pad_vocab_to is not None:
            return self.pad_vocab_to
        return VOCAB_PAD_BASE * tensor if tensor > 1 and self.vocab % tensor else 1

    def kv_split(self, tensor: int) -> bool:
        """Whether the tensor axis splits the K/V heads (it divides ``kv_heads``); else each rank holds all of them."""
        return self.num_kv_heads % tensor == 0

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the MLP: 2 (GELU), 3 (SwiGLU)."""
        return 3 if self.mlp is Mlp.SWIGLU else 2
