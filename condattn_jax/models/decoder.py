"""One Flax Linen decoder for the llama | qwen2 | qwen3 | olmo2 families.

embed -> scanned scheme layers (attention scheme + MLP) -> final RMSNorm -> logits.

The layers run under `nn.scan` (MaxText style): one layer body is traced and compiled however
many layers the model has, with remat inside the body. Runs of consecutive layers with the same
scheme variant (`Scheme.layer_variants`) form one scanned group each (parameters under `layers`,
or `layers_{start}_{stop}` when there are several groups; see `models.stacking`). Per-layer
values (`Scheme.layer_flags`) and the layer index are scanned inputs that reach the layer in its
`LayerContext`.

Decoding for the inference engine (`unroll_layers=True`, MaxText's unrolled decode): the layers
run as a python loop, each on its slice of the stacked parameters, with ONE cache per layer
(`cache/layers_{i}`), so a jitted step that donates the cache writes every layer's new K/V into
that layer's buffer in place (a scan would carry the stacked cache [L, ...] through the loop and
copy it). `models.stacking.stack_layers(cache, variants)` views such a cache in the scanned
layout, `unstack_layers` goes back. The stacked parameters may be given split
(`models.stacking.split_groups`: each group a tuple of per-layer trees) in this mode.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from condattn_jax.attention import get_scheme
from condattn_jax.models.config import ModelConfig
from condattn_jax.models.context import LayerContext
from condattn_jax.models.layers import INIT_STD, make_norm, shared_decode_fill, shares_kv_state
from condattn_jax.models.stacking import group_name, layer_groups

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
ACTIVATION = ("activation_batch", "activation_length", "activation_embed")


def _body(layer: nn.Module, x_BTD, per_layer, ctx: LayerContext):
  """The scanned step for one layer: its index and flags go into the context."""
  layer_idx, flags = per_layer
  x_BTD, aux = layer(x_BTD, ctx.replace(layer_idx=layer_idx, layer_flags=flags))
  return nn.with_logical_constraint(x_BTD, ACTIVATION), aux


def scanned_layers(cfg: ModelConfig, layer: nn.Module, length: int):
  """`(x, per_layer, ctx) -> (x, aux)` running `layer` `length` times under nn.scan(remat(.)):
  params/cache/intermediates stacked on axis 0 (logical axis 'layers'), a fresh RNG per layer
  for every stream, the context broadcast."""
  body = _body
  if cfg.remat_policy != "none":
    body = nn.remat(body, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)
  scan = nn.scan(body, variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                 split_rngs={"params": True, "router": True, "dropout": True},
                 in_axes=(0, nn.broadcast), length=length,
                 metadata_params={nn.PARTITION_NAME: "layers"})
  return lambda x, per_layer, ctx: scan(layer, x, per_layer, ctx)


class Decoder(nn.Module):
  """Causal LM.

  __call__(tokens_BT, positions_BT=None, segment_ids_BT=None, *, task_ids_B=None, fields=None,
           train, decode, cache_len, return_hidden) -> (logits_BTV float32 | hidden_BTD, aux)
  `aux` holds the scheme's per-layer outputs stacked on a leading layer axis (L), plus
  aux['scheme'] (the scheme module's model-level values, `Scheme.module`) when it returns any.
  Decoding (decode=True, cache_len, mutable=['cache']): every layer reads and writes its cache;
  `segment_ids_BT` then marks the chunk's valid tokens (1) and right padding (0) of ragged rows.
  unroll_layers (decode with existing params only): one cache per layer, `cache/layers_{i}`,
  layers unrolled (see the module docstring); False: the scanned groups' stacked caches.
  `return_hidden` returns the final-norm hidden states instead of logits.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, *, task_ids_B=None,
               fields=None, train: bool = False, decode: bool = False,
               cache_len: int | None = None, return_hidden: bool = False,
               unroll_layers: bool = False):
    cfg = self.config
    B, T = tokens_BT.shape
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    embed = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
        embedding_init=nn.with_logical_partitioning(nn.initializers.normal(INIT_STD),
                                                    ("vocab", "embed")),
        name="embed_tokens")
    x_BTD = nn.with_logical_constraint(embed(tokens_BT), ACTIVATION)
    ctx = LayerContext(tokens_BT=tokens_BT, positions_BT=positions_BT,
                       segment_ids_BT=segment_ids_BT, task_ids_B=task_ids_B,
                       fields=dict(fields or {}), train=train, decode=decode,
                       cache_len=cache_len)

    scheme = get_scheme(cfg.scheme)
    scheme_aux = {}
    if scheme.module is not None:  # MATCH: retrieval + auxiliary rows; Elastic: multipliers
      extra_BA, fields, scheme_aux = scheme.module(cfg, name="scheme")(tokens_BT, ctx)
      ctx = ctx.replace(fields={**ctx.fields, **fields})
      if extra_BA is not None:
        x_BTD = jnp.concatenate([x_BTD, embed(extra_BA)], axis=1)
    variants = tuple(scheme.layer_variants(cfg))
    if len(variants) != cfg.num_layers:
      raise ValueError(f"scheme {cfg.scheme!r}.layer_variants gave {len(variants)} variants for "
                       f"model.num_layers={cfg.num_layers}.")
    flags = {k: np.asarray(v) for k, v in scheme.layer_flags(cfg).items()}
    groups = layer_groups(variants)
    auxes = []
    if unroll_layers:
      if not decode or self.is_initializing():
        raise ValueError("Decoder(unroll_layers=True) is for decoding with existing params "
                         "(decode=True, apply); initialise with the scanned layers.")
      x_BTD, aux = self._unrolled(scheme, groups, flags, x_BTD, ctx)
      groups = ()
      auxes.append(aux)
    for start, stop, variant in groups:
      per_layer = (jnp.arange(start, stop, dtype=jnp.int32),
                   {k: jnp.asarray(v[start:stop]) for k, v in flags.items()})
      layer = scheme.layer_cls(cfg, variant=variant, name=group_name(start, stop, len(groups)))
      x_BTD, aux = scanned_layers(cfg, layer, stop - start)(x_BTD, per_layer, ctx)
      auxes.append(aux)
    aux = (auxes[0] if len(auxes) == 1
           else jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *auxes))
    if scheme_aux:
      aux = {**aux, "scheme": scheme_aux}
    x_BTD = make_norm(cfg, "norm")(x_BTD[:, :T])
    if return_hidden:
      return x_BTD, aux
    if cfg.tie_word_embeddings:
      logits = embed.attend(x_BTD)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype,
                        param_dtype=cfg.weight_dtype,
                        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(INIT_STD),
                                                                 ("embed", "vocab")),
                        name="lm_head")(x_BTD)
    return logits.astype(jnp.float32), aux

  def _unrolled(self, scheme, groups, flags, x_BTD, ctx: LayerContext):
    """Every layer applied on its parameter slice with its own cache `cache/layers_{i}`
    (created by the layer itself on the first call); aux stacked on a leading layer axis.
    A group given split (`models.stacking.split_groups`: a tuple of per-layer trees) is used
    as is: each layer's weights are then their own arguments of the step, never a slice of
    the stacked array (which a compiler may copy into a new buffer every step)."""
    cfg = self.config
    params = self.variables["params"]
    fill_B = (shared_decode_fill(cfg, self.get_variable("cache", "layers_0"), ctx.valid_BT,
                                 ctx.cache_len) if self.has_variable("cache", "layers_0") else None)
    if fill_B is not None:  # one per step, for every layer's attention (models.layers)
      ctx = ctx.replace(fields={**ctx.fields, "decode_fill_B": fill_B})
    # models.layers.shares_kv_state: layers after the first write at layer 0's slots and read
    # its positions / valid / length after the write (only layers_0 holds them)
    share = shares_kv_state(cfg)
    if share:
      B = x_BTD.shape[0]
      kv0 = (self.get_variable("cache", "layers_0")["self_attn"]["cache"]
             if self.has_variable("cache", "layers_0") else {})
      old_len_B = kv0["length"] if "length" in kv0 else jnp.zeros((B,), jnp.int32)
    auxes = []
    for start, stop, variant in groups:
      layer = scheme.layer_cls(cfg, variant=variant, parent=None)
      group = params[group_name(start, stop, len(groups))]
      split = isinstance(group, (tuple, list))  # models.stacking.split_groups: no slicing
      if split and len(group) != stop - start:
        raise ValueError(f"params[{group_name(start, stop, len(groups))!r}] holds {len(group)} "
                         f"layers; the model's group has {stop - start} (split_groups of "
                         "another config's params?).")
      for i in range(start, stop):
        name = f"layers_{i}"
        variables = {"params": group[i - start] if split else
                     jax.tree.map(lambda a, j=i - start: a[j], group)}
        if self.has_variable("cache", name):
          variables["cache"] = self.get_variable("cache", name)
        lctx = ctx.replace(layer_idx=jnp.int32(i),
                           layer_flags={k: jnp.asarray(v[i]) for k, v in flags.items()})
        if share and i > 0:
          lctx = lctx.replace(fields={**lctx.fields, "kv_state": state})
        (x_BTD, aux), new = layer.apply(variables, x_BTD, lctx, mutable=["cache"])
        if share and i == 0:
          kv = new["cache"]["self_attn"]["cache"]
          state = dict(length=old_len_B, new_length=kv["length"], positions=kv["positions"],
                       valid=kv["valid"])
        x_BTD = nn.with_logical_constraint(x_BTD, ACTIVATION)
        if "cache" in new:
          self.put_variable("cache", name, new["cache"])
        auxes.append(aux)
    return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

  def output_embedding(self, params):
    """[D, V] matrix mapping final hidden states to logits (for chunked / fused losses)."""
    if self.config.tie_word_embeddings:
      return params["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]
