"""LoRA adapters in device slots, and the per-token delta `x @ A_slot @ B_slot` they add to the linear layers.

`--max-loras` slots each hold one adapter's A and B (its scale folded into B) for the seven projections a Llama or
Gemma 3 block has (q, k, v, o, gate, up, down), padded with zeros to `--max-lora-rank`; an adapter that leaves a
projection out has zeros there. Each token of a step carries its row's slot (-1: none, the base model).

The delta is computed densely over the slots: one matmul takes the token to every slot's rank-R space at once
([T, in] x [in, slots * R]), a one-hot mask keeps its own slot's R columns (zeros for base rows), a second matmul
brings them back ([T, slots * R] x [slots * R, out]). Two ordinary matmuls XLA runs well, with no gather of
per-token weights (a gathered A of [T, R, in] is larger than the weights themselves in a big batch); the extra work is
slots * R columns per projection (8 x 16 = 128: a few per cent of a 1B model's matmuls)."""

from __future__ import annotations

import itertools
import os

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from .config import ModelConfig
from .folded_weight import FoldedWeight
from .quantization import as_matrices, folded_matmul
from .quantization import linear as base_linear

# the projections a block has (Hugging Face's module names, ModelConfig.linear_shapes), q/k/v and gate/up in the order
# LoRALayer stacks them
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALayer(eqx.Module):
    """One layer's adapters: a leading [slots] axis on every array, then rank R; B is scaled already."""

    qkv_a: jax.Array  # [L, 3, R, Embed]: q, k and v read the same input
    # [L, 3, R, KVHeads, QKV, HeadSize]: q's B in the fused projection's query columns, k's and v's in theirs, zeros
    # elsewhere: one matmul brings all three back (decode steps are bound by kernels, not by these few bytes)
    qkv_b: jax.Array
    o_a: jax.Array  # [L, R, KVHeads, QPerKV, HeadSize]
    o_b: jax.Array  # [L, R, Embed]
    gate_up_a: jax.Array  # [L, 2, R, Embed]
    gate_up_b: jax.Array  # [L, 2, R, Mlp]
    down_a: jax.Array  # [L, R, Mlp]
    down_b: jax.Array  # [L, R, Embed]


def layer_shapes(cfg: ModelConfig, slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    E, I, D, KVH, G = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_kv_heads, cfg.queries_per_kv
    L, R = slots, rank
    return {
        "qkv_a": (L, 3, R, E),
        "qkv_b": (L, 3, R, KVH, G + 2, D),
        "o_a": (L, R, KVH, G, D),
        "o_b": (L, R, E),
        "gate_up_a": (L, 2, R, E),
        "gate_up_b": (L, 2, R, I),
        "down_a": (L, R, I),
        "down_b": (L, R, E),
    }


class LoRAStack(eqx.Module):
    """Every layer's slots (DecoderModel.lora). Writing a slot replaces arrays, never the program: the shapes are
    fixed by the slots and the rank, so adapters come and go without recompiling."""

    layers: tuple[LoRALayer, ...]

    @property
    def slots(self) -> int:
        return self.layers[0].qkv_a.shape[0]

    @property
    def rank(self) -> int:
        return self.layers[0].qkv_a.shape[2]

    @staticmethod
    def allocate(cfg: ModelConfig, slots: int, rank: int, dtype) -> LoRAStack:
        shapes = layer_shapes(cfg, slots, rank)
        return LoRAStack(
            tuple(
                LoRALayer(**{name: jnp.zeros(shape, dtype) for name, shape in shapes.items()})
                for _ in range(cfg.num_layers)
            )
        )


def slot_weights(
    cfg: ModelConfig, rank: int, modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]], dtype
) -> tuple[dict[str, np.ndarray], ...]:
    """One adapter laid out as one slot of every layer (no slots axis): modules maps (layer, projection) to its A
    [r, in] and its scaled B [out, r] (r <= rank); what it leaves out is zeros. Host arrays in the model's dtype.
    cfg is the served model's: query heads keep their order when tensor parallelism regroups them under replicated
    KV heads, so q and o reshape to its grouping, and k and v repeat each head as the KV heads were."""
    E, I, D, KVH, G = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_kv_heads, cfg.queries_per_kv
    shapes = {name: shape[1:] for name, shape in layer_shapes(cfg, 1, rank).items()}
    layers = []
    for i in range(cfg.num_layers):
        w = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        for p, (a, b) in ((p, modules[(i, p)]) for p in PROJECTIONS if (i, p) in modules):
            r = a.shape[0]
            bt = b.T  # [r, out]
            if p in ("q_proj", "k_proj", "v_proj"):
                part = PROJECTIONS.index(p)
                w["qkv_a"][part, :r] = a
                if p == "q_proj":
                    w["qkv_b"][0, :r, :, :G] = bt.reshape(r, KVH, G, D)
                else:  # a KV head replicated for tensor parallelism (tensor_parallel.py) takes its head's B
                    heads = bt.shape[1] // D
                    w["qkv_b"][part, :r, :, G + part - 1] = np.repeat(bt.reshape(r, heads, D), KVH // heads, axis=1)
            elif p == "o_proj":
                w["o_a"][:r] = a.reshape(r, KVH, G, D)
                w["o_b"][:r] = bt.reshape(r, E)
            elif p in ("gate_proj", "up_proj"):
                part = 0 if p == "gate_proj" else 1
                w["gate_up_a"][part, :r] = a
                w["gate_up_b"][part, :r] = bt.reshape(r, I)
            else:
                w["down_a"][:r] = a.reshape(r, I)
                w["down_b"][:r] = bt.reshape(r, E)
        layers.append({name: x.astype(dtype) for name, x in w.items()})
    return tuple(layers)


def _finite(w: jax.Array) -> jax.Array:
    """w with its NaN and infinite values zeroed. The loader refuses such adapters (peft.py); this keeps one that got
    past it (a dtype's overflow, a caller's own weights) in its own rows: the dense expand contracts every slot's B for
    every token, and 0 * NaN is NaN, so a non-finite weight in any slot would reach every row of the step."""
    return jnp.where(jnp.isfinite(w), w, jnp.zeros((), w.dtype))


def _write_slot(stack: LoRAStack, slot: jax.Array, weights: tuple[dict[str, jax.Array], ...]) -> LoRAStack:
    layers = tuple(
        LoRALayer(**{name: getattr(layer, name).at[slot].set(_finite(w[name].astype(layer.qkv_a.dtype))) for name in w})
        for layer, w in zip(stack.layers, weights, strict=True)
    )
    return LoRAStack(layers)


# Not donated: a dispatch queued earlier may still read the old arrays (the stack is small; the copy is cheap).
write_slot_fn = jax.jit(_write_slot)


def _projections(model) -> list:
    """Every block's four projection weights, in WEIGHTS's order, block after block."""
    return [getattr(getattr(block, part), field) for block in model.layers for part, field in WEIGHTS.values()]


def _contracted(kind: str, a: jax.Array) -> int:
    """k of the projection `kind`: the size of A's axes that its shrink contracts (A [slots, ..., k's axes])."""
    inputs, out = SPECS[kind][2].split("->")
    return int(np.prod([n for n, c in zip(a.shape, inputs.split(",")[1], strict=True) if c not in out]))


def _with_kinds(weights: list, layers) -> zip:
    """Each of _projections's weights with its layer's entry of `layers` (one per block) and its SPECS kind."""
    return zip(weights, itertools.product(layers, WEIGHTS), strict=True)


def folds_stored(model, devices: int) -> bool:
    """Whether a LoRA engine's model (its slots allocated) stores its projections folded (FOLD_STORED): on one
    device, every projection a dense weight with its contracted axes last."""
    if FOLD_STORED == "0" or devices != 1 or model.lora is None:
        return False
    if FOLD_STORED == "auto" and (jax.default_backend() != "gpu" or model.lora.slots > FOLD_STORED_MAX_SLOTS):
        return False
    for w, (layer, kind) in _with_kinds(_projections(model), model.lora.layers):
        k = _contracted(kind, getattr(layer, SPECS[kind][0]))
        if not isinstance(w, NamedArray) or k not in np.cumprod([ax.size for ax in reversed(w.axes)]):
            return False  # quantized, or laid out for the CPU's loops (cpu_layout.py)
    return True


def fold_weights(model):
    """The model with each projection stored with its layer's slots' A rows after its own (FoldedWeight)."""
    folded = []
    for w, (layer, kind) in _with_kinds(_projections(model), model.lora.layers):
        a = getattr(layer, SPECS[kind][0])
        folded.append(FoldedWeight.fold(w, a.reshape(-1, _contracted(kind, a))))
    return eqx.tree_at(_projections, model, folded)


def _write_folded(folded: list[FoldedWeight], slot: jax.Array, weights: tuple[dict[str, jax.Array], ...]) -> list:
    out = []
    for w, (layer, kind) in _with_kinds(folded, weights):
        rows = _finite(layer[SPECS[kind][0]].reshape(-1, w.matrix.shape[1]))  # one slot's A (no slots axis) as rows
        out.append(w.with_rows(slot * rows.shape[0], rows))
    return out


# Donated: written in place (a copy would hold every projection twice); the engine settles dispatches queued ahead
# first (they read the old arrays).
_write_folded_fn = jax.jit(_write_folded, donate_argnums=0)


def write_folded_slot(model, slot: int, weights: tuple[dict[str, np.ndarray], ...]):
    """The folded model (fold_weights) with one slot's A rows written; the old model's folded arrays are donated."""
    return eqx.tree_at(_projections, model, _write_folded_fn(_projections(model), np.int32(slot), weights))


def is_folded(model) -> bool:
    return bool(model.layers) and isinstance(model.layers[0].attn.qkv_proj, FoldedWeight)


# Steps of at most this many tokens gather each token's own slot's A and B instead of computing every slot's rank
# space (CAPSTAN_LORA_GATHER_MAX_TOKENS; 0: never; 16 by default: one stream 1.20x the base's time a token against
# 1.40x, H100). Both are exact; the gathered weights grow with the tokens, so large steps always take the dense way.
GATHER_MAX_TOKENS = int(os.environ.get("CAPSTAN_LORA_GATHER_MAX_TOKENS", "16"))
# How gathered steps contract (CAPSTAN_LORA_GATHER_WAY): "products" as broadcast products summed in float32, which XLA
# fuses with the gather (and the expand with the add into y) instead of launching matmul kernels: a one-stream decode
# step is bound by kernel launches, not by these few bytes; "einsum": XLA's matmuls on the gathered weights.
GATHER_WAY = os.environ.get("CAPSTAN_LORA_GATHER_WAY", "products")


def _gathered(spec: str, operand: int) -> str:
    """A dense spec over the slot axis l made per token: operand's l becomes t, and l leaves the other operands."""
    inputs, out = spec.split("->")
    parts = inputs.split(",")
    parts = [p.replace("l", "t") if k == operand else p.replace("l", "") for k, p in enumerate(parts)]
    return ",".join(parts) + "->" + out.replace("l", "")


def _products(spec: str, p: jax.Array, q: jax.Array) -> jax.Array:
    """jnp.einsum(spec, p, q) as a broadcast product summed over the contracted letters, in float32: elementwise work
    XLA fuses with its neighbours (a gather, an add), never a matmul kernel of its own."""
    (sp, sq), out = spec.split("->")[0].split(","), spec.split("->")[1]
    letters = list(dict.fromkeys(sp + sq))

    def spread(x: jax.Array, sub: str) -> jax.Array:  # x's axes in `letters` order, size 1 where it has none
        present = [c for c in letters if c in sub]
        x = jnp.transpose(x.astype(jnp.float32), [sub.index(c) for c in present])
        return x.reshape([x.shape[present.index(c)] if c in sub else 1 for c in letters])

    summed = spread(p, sp) * spread(q, sq)
    summed = summed.sum(axis=tuple(i for i, c in enumerate(letters) if c not in out))
    kept = [c for c in letters if c in out]
    return jnp.transpose(summed, [kept.index(c) for c in out])


# Projections whose shrink rides in the base weight's own matmul in steps that gather (CAPSTAN_LORA_FOLD: a comma
# list of qkv, out, gate_up, down, or "all"; empty: none): the dot reads [W; every slot's A] at once, so a decode step
# launches one kernel fewer per projection (a one-stream step is bound by its kernels' count); each token's R columns
# are picked from every slot's after it. Dense (unquantized) weights on one device only. Off by default: on the H100
# one stream took 1.180x the base's time a token against 1.195x unfolded (same call; the dots reading the extra
# columns got slower by about what the four fewer kernels a layer saved), benchmarks/RESULTS.md.
_FOLD = os.environ.get("CAPSTAN_LORA_FOLD", "")
FOLD = frozenset(("qkv", "out", "gate_up", "down") if _FOLD == "all" else filter(None, _FOLD.split(",")))

# The shrinks folded into weights stored with the slots' A rows (folded_weight.py; CAPSTAN_LORA_FOLD_STORED: "1" on,
# "0" off, "auto": on a GPU): one plain matmul a projection, nothing concatenated in the step. On one device with
# dense weights only. H100, one stream (benchmarks/RESULTS.md): one slot 1.107x the base's time a token against
# 1.196x with the shrinks apart; eight slots 1.149x, but their 256-request batch with it is unmeasured, so "auto"
# folds up to FOLD_STORED_MAX_SLOTS slots.
FOLD_STORED = os.environ.get("CAPSTAN_LORA_FOLD_STORED", "auto")
FOLD_STORED_MAX_SLOTS = 2
# Where each projection's weight is in a block, by SPECS's kind
WEIGHTS = {
    "qkv": ("attn", "qkv_proj"),
    "out": ("attn", "o_proj"),
    "gate_up": ("mlp", "gate_up_proj"),
    "down": ("mlp", "down_proj"),
}

# Decode steps through the fused decode kernel add the q/k/v delta inside it (CAPSTAN_LORA_QKV_IN_KERNEL=1): its
# expand and its add are no kernels of their own (two of the seven small kernels an adapter adds to a one-stream
# layer, benchmarks/RESULTS.md). Off: slower on the H100 (1.249x the base's time a token against 1.205x; the kernel
# went from 4.8 to 9.7 us a layer, each of its programs summing the slot's B rows before its attention).
QKV_IN_KERNEL = os.environ.get("CAPSTAN_LORA_QKV_IN_KERNEL", "") == "1"

# Each projection's (A, B) fields of LoRALayer, the dense shrink and expand specs (over every slot, l)
SPECS = {
    "qkv": ("qkv_a", "qkv_b", "te,lpre->tlpr", "tlpr,lprkqd->tkqd"),
    "out": ("o_a", "o_b", "tkgd,lrkgd->tlr", "tlr,lre->te"),
    "gate_up": ("gate_up_a", "gate_up_b", "te,lpre->tlpr", "tlpr,lpri->tpi"),
    "down": ("down_a", "down_b", "ti,lri->tlr", "tlr,lre->te"),
}


class LayerAdapters(eqx.Module):
    """What a block needs to add its adapters' deltas: its layer's slots and each token's slot [T] (-1: none)."""

    weights: LoRALayer
    slots: jax.Array

    def _delta(self, x: jax.Array, a: jax.Array, b: jax.Array, shrink: str, expand: str) -> jax.Array:
        """x @ A @ B of each token's own slot; shrink and expand are the dense specs (over every slot, l)."""
        if self.slots.shape[0] <= GATHER_MAX_TOKENS:
            contract = _products if GATHER_WAY == "products" else jnp.einsum
            return self._expand_own(contract(_gathered(shrink, 1), x, a[jnp.maximum(self.slots, 0)]), b, expand)
        return self._expand_every(jnp.einsum(shrink, x, a), b, expand)

    def _expand_every(self, h: jax.Array, b: jax.Array, expand: str) -> jax.Array:
        """h [T, L, ..., R], every slot's rank space, back through each token's own slot's B (zeros for base rows):
        its own slot picked (few tokens) or the others masked (many: two dense matmuls, no per-token weights)."""
        T, L = self.slots.shape[0], h.shape[1]
        if T <= GATHER_MAX_TOKENS:
            return self._expand_own(h[jnp.arange(T), jnp.maximum(self.slots, 0)], b, expand)
        # one-hot, a row of zeros for -1; selected, not multiplied: another slot's Inf or NaN times 0 would be NaN
        rows = self.slots[:, None] == jnp.arange(L)[None, :]
        return jnp.einsum(expand, jnp.where(rows.reshape((T, L) + (1,) * (h.ndim - 2)), h, 0), b)

    def _base_rows_zeroed(self, h: jax.Array) -> jax.Array:
        """h [T, ...] with the rows of tokens that have no adapter (slot -1) zeroed (selected: NaN * 0 is NaN)."""
        return jnp.where((self.slots >= 0).reshape((self.slots.shape[0],) + (1,) * (h.ndim - 1)), h, 0)

    def _expand_own(self, h: jax.Array, b: jax.Array, expand: str) -> jax.Array:
        """h [T, ..., R], each token's own slot's rank space, back through its slot's B (zeros for base rows: they
        gathered slot 0's weights, whose values must not reach them)."""
        contract = _products if GATHER_WAY == "products" else jnp.einsum
        return self._base_rows_zeroed(
            contract(_gathered(expand, 1), self._base_rows_zeroed(h), b[jnp.maximum(self.slots, 0)])
        )

    def _folded(self, kind: str, x: NamedArray, w, axis) -> NamedArray | None:
        """x through the projection `kind` (SPECS) with its adapters' deltas, the shrink folded into the weight's
        matmul: a weight stored with every slot's A (FoldedWeight, FOLD_STORED), or [W; every slot's A] concatenated
        in the step (FOLD, small steps); None where it does not fold (the caller adds the delta to its own matmul's
        result)."""
        T = self.slots.shape[0]
        a_field, b_field, _, expand = SPECS[kind]
        a, b = getattr(self.weights, a_field), getattr(self.weights, b_field)
        if isinstance(w, FoldedWeight):
            base, tail = folded_matmul(x, w, axis)
        else:
            if kind not in FOLD or not isinstance(w, NamedArray) or T > GATHER_MAX_TOKENS:
                return None
            m = as_matrices(x, w, axis)
            if m is None or m.rows != T:
                return None
            # every slot's A, even for one token: XLA reads [W; A] in the dot's own fusion only when A is a whole
            # array (with the token's slot sliced out first it copied W a step: one stream 2.2x the base's time, H100)
            both = jnp.concatenate([w.array.reshape(m.n, m.k), a.reshape(-1, m.k).astype(w.dtype)])
            y = jnp.dot(m.xs, both.T)  # [T, n + slots * parts * R]
            base, tail = m.result(y[:, : m.n]), y[:, m.n :]
        ranks = a.shape[1 : len(expand.split(",")[0]) - 1]  # the slot's rank-space axes: (parts,) R
        delta = self._expand_every(tail.reshape(T, a.shape[0], *ranks), b, expand)
        return base + hax.named(delta.astype(base.dtype), base.axes)

    def qkv_in_kernel(self, x: NamedArray, token: str, ax) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """For a step the fused decode kernel runs (QKV_IN_KERNEL, gathered steps): (h [T, 3R] float32, each token's
        own rank space, zeros for base rows; every slot's B [slots, 3R, KVHeads, QKV, HeadSize]; each token's slot),
        the kernel's `lora` argument. None: the caller adds the delta itself."""
        T = self.slots.shape[0]
        if not QKV_IN_KERNEL or T > GATHER_MAX_TOKENS or GATHER_WAY != "products":
            return None
        s = jnp.maximum(self.slots, 0)
        xs = x.rearrange((token, ax.Embed)).array
        h = self._base_rows_zeroed(_products(_gathered(SPECS["qkv"][2], 1), xs, self.weights.qkv_a[s]))  # [T, 3, R]
        b = self.weights.qkv_b
        return h.reshape(T, -1), b.reshape(b.shape[0], -1, *b.shape[3:]), s

    def project(self, kind: str, x: NamedArray, w, axis, token: str, ax) -> NamedArray:
        """x @ w plus the delta of each token's adapter: folded (linear) where it can be, else the base's matmul and
        the delta apart."""
        y = self._folded(kind, x, w, axis)
        return y if y is not None else getattr(self, kind)(x, base_linear(x, w, axis=axis), token, ax)

    def _add(self, kind: str, x: NamedArray, x_axes: tuple, y: NamedArray, y_axes: tuple) -> NamedArray:
        """y (the projection's base output, y_axes after the token) plus the delta for x (x_axes after the token)."""
        a_field, b_field, shrink, expand = SPECS[kind]
        token = y.axes[0]
        xs = x.rearrange((token.name, *x_axes)).array
        delta = self._delta(xs, getattr(self.weights, a_field), getattr(self.weights, b_field), shrink, expand)
        return y + hax.named(delta.astype(y.dtype), (token, *y_axes))

    def qkv(self, x: NamedArray, qkv: NamedArray, token: str, ax) -> NamedArray:
        """qkv [token, KVHeads, QKV, HeadSize] plus the q, k and v deltas for x [token, Embed]."""
        return self._add(
            "qkv",
            x,
            (ax.Embed,),
            qkv.rearrange((token, ax.KVHeads, ax.QKV, ax.HeadSize)),
            (ax.KVHeads, ax.QKV, ax.HeadSize),
        )

    def out(self, x: NamedArray, y: NamedArray, token: str, ax) -> NamedArray:
        """o_proj's y [token, Embed] plus the delta for x [token, KVHeads, QPerKV, HeadSize]."""
        return self._add("out", x, (ax.KVHeads, ax.QPerKV, ax.HeadSize), y.rearrange((token, ax.Embed)), (ax.Embed,))

    def gate_up(self, x: NamedArray, y: NamedArray, token: str, ax) -> NamedArray:
        """The fused gate/up y [token, GateUp, Mlp] plus both deltas for x [token, Embed]."""
        return self._add("gate_up", x, (ax.Embed,), y.rearrange((token, ax.GateUp, ax.Mlp)), (ax.GateUp, ax.Mlp))

    def down(self, x: NamedArray, y: NamedArray, token: str, ax) -> NamedArray:
        """down_proj's y [token, Embed] plus the delta for x [token, Mlp]."""
        return self._add("down", x, (ax.Mlp,), y.rearrange((token, ax.Embed)), (ax.Embed,))
