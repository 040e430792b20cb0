"""HybridModel: embedding, a stack of hybrid layers given by the pattern, final norm, LM head,
and optional multi-token-prediction (MTP) depths.

Every physical layer is a residual block, pre-norm `h + mixer(norm(h))` or, in the decoder layers
of the mixers named in `post_norm_mixers`, post-norm `h + norm(mixer(h))`. With hyper-connections
(`hc_mult` = N > 0, model/hyper_connections.py) the residual stream is N streams [B, T, N, D]:
each layer reads its input from them and writes its output back through its own
`hyper_connection`, the embedding enters as N copies, and `hc_head` collapses the streams before
the final norm.

A bracket group is a nested HybridStack: a scheduling / sharding / checkpoint unit that computes
exactly what the same layers computed flat. Layers are kept in ModuleDicts keyed by their index so that pipeline stages
can drop layers without renaming the others (torchtitan's convention).

Forward returns the logits, or a tuple `(logits, aux_loss, *mtp_logits)` when the pattern has MoE
layers or MTP depths; `titan_hybrid.training.loss` turns either into the training loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from titan_hybrid.model.args import HybridModelArgs
from titan_hybrid.model.hyper_connections import HyperConnection, HyperHead, expand_streams
from titan_hybrid.model.layer_kind import LayerKind
from titan_hybrid.model.layer_kinds import kind_of
from titan_hybrid.model.layout import TokenLayout
from titan_hybrid.model.norms import RMSNorm
from titan_hybrid.model.pattern import Item, members, physical_symbols, written
from titan_hybrid.model.rotary import rotary_tables


def model_norm(args: HybridModelArgs) -> RMSNorm:
    """A norm over the model's width: a layer's input norm, the final norm, MTP's norms."""
    return RMSNorm(args.dim, eps=args.norm_eps, zero_centered=args.norm_zero_centered)


class HybridLayer(nn.Module):
    """One physical layer: a layer kind of the table (model/layer_kinds.py), or a parallel
    group's kinds (pattern `(M*)`), which read the same normed input and whose outputs add up.
    Submodules are named by kind (`attention_norm`, `attention`, ...; a parallel group's one
    norm after all its kinds, `mamba_attention_norm`) so that checkpoint keys say what a layer
    is, as Megatron's do."""

    def __init__(self, symbol: str, args: HybridModelArgs, *, post_norm: bool = False,
                 hash_routed: bool = False) -> None:
        """`hash_routed`: an MoE layer that chooses its experts by the token ids."""
        super().__init__()
        self.symbol = symbol
        self.kinds = tuple(kind_of(member, args) for member in members(symbol))
        self.post_norm = post_norm  # h + norm(mixer(h)) instead of h + mixer(norm(h))
        self.norm_name = "_".join(kind.name for kind in self.kinds) + "_norm"
        self.add_module(self.norm_name, model_norm(args))
        for kind in self.kinds:
            section = args.section(kind)
            if hash_routed:
                section = dataclasses.replace(section, hash_vocab_size=args.vocab_size)
            self.add_module(kind.name, kind.build(section, args.dim, args.norm_eps))
        self.residual_multiplier = args.residual_multiplier
        self.hyper_connection = (HyperConnection(args.dim, args.hc_mult,
                                                 sinkhorn_iters=args.hc_sinkhorn_iters,
                                                 eps=args.hc_eps, norm_eps=args.norm_eps)
                                 if args.hc_mult else None)

    def mixers(self) -> list[tuple[LayerKind, nn.Module]]:
        """(kind, mixer) of each of the layer's kinds, in the pattern's order."""
        return [(kind, getattr(self, kind.name)) for kind in self.kinds]

    @property
    def kind(self) -> LayerKind:
        """The kind of a layer of one kind (a parallel group has several: `kinds`)."""
        if len(self.kinds) != 1:
            raise AttributeError(f"a parallel group's layer ({written(self.symbol)}) has "
                                 "several kinds: read `kinds` or `mixers()`")
        return self.kinds[0]

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.kind.name)

    @property
    def norm(self) -> nn.Module:
        return getattr(self, self.norm_name)

    def forward(self, h: torch.Tensor, aux_loss: torch.Tensor, layout: TokenLayout):
        """`h`: the residual stream [B, T, D], or the streams [B, T, N, D] with
        hyper-connections."""
        if self.hyper_connection is not None:
            x, post, comb = self.hyper_connection(h)
        else:
            x = h
        x = x if self.post_norm else self.norm(x)
        out, with_aux_loss = None, False
        for kind, mixer in self.mixers():
            if kind.mixes_sequence:
                mixed = mixer(x, layout)
            elif getattr(mixer, "routes_by_token", False):
                mixed = mixer(x, layout.token_ids)
            else:
                mixed = mixer(x)
            if kind.has_aux_loss:
                mixed, layer_aux_loss = mixed
                aux_loss, with_aux_loss = aux_loss + layer_aux_loss, True
            out = mixed if out is None else out + mixed
        if not with_aux_loss and aux_loss.requires_grad:
            # Not the input itself: FSDP2 hands a unit its inputs as views (of its hook
            # function's outputs), and a unit that returned one as it came would return a view,
            # whose in-place update downstream would skip the unit's pre-backward hook (torch
            # warns). The aux loss is one number: the copy costs nothing measurable.
            aux_loss = aux_loss.clone()
        if self.post_norm:
            out = self.norm(out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        if self.hyper_connection is not None:
            return self.hyper_connection.combine(h, out, post, comb), aux_loss
        return h + out, aux_loss

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        self.norm.init_weights()
        for _, mixer in self.mixers():
            mixer.init_weights(init_std=init_std, out_std=out_std)
        if self.hyper_connection is not None:
            self.hyper_connection.init_weights(init_std=init_std)


class HybridStack(nn.Module):
    """A sequence of pattern items; a bracket group becomes a nested HybridStack."""

    def __init__(self, items: list[Item], args: HybridModelArgs, *, first_index: int = 0,
                 post_norms: list[bool] | None = None,
                 hash_routed: list[bool] | None = None) -> None:
        """`post_norms`: each physical layer's placement of its norm, in order (default:
        args.post_norms(items)); `hash_routed`: each physical layer's routing by token id
        (default: none, as in MTP depths; the main stack's: args.hash_routed(items))."""
        super().__init__()
        flags = iter(args.post_norms(items) if post_norms is None else post_norms)
        hashed = iter(hash_routed or [False] * sum(len(physical_symbols(item)) for item in items))
        self.layers = nn.ModuleDict()
        for offset, item in enumerate(items):
            layer = (HybridStack(list(item), args, post_norms=[next(flags) for _ in item],
                                 hash_routed=[next(hashed) for _ in item])
                     if isinstance(item, tuple)
                     else HybridLayer(item, args, post_norm=next(flags),
                                      hash_routed=next(hashed)))
            self.layers[str(first_index + offset)] = layer

    def forward(self, h: torch.Tensor, aux_loss: torch.Tensor, layout: TokenLayout):
        for layer in self.layers.values():
            h, aux_loss = layer(h, aux_loss, layout)
        return h, aux_loss

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        for layer in self.layers.values():
            layer.init_weights(init_std=init_std, out_std=out_std)


class MTPDepth(nn.Module):
    """One MTP depth: combine the previous depth's output with the embedding of the token k
    steps ahead, run the MTP layers, and predict one token further.

    DeepSeek-V3 style (no hyper-connections): as in Megatron (and the published checkpoints'
    inference code: vLLM, SGLang), the input is the previous output AFTER its final norm (the
    main model's, for depth 1), and eh_proj reads [normed embedding | normed input], in that
    order.

    DeepSeek-V4 style (with hyper-connections, as DeepSeek's reference code and Megatron's
    HybridModel): the input is the previous depth's streams BEFORE their hyper head (the main
    model's, for depth 1), each stream normed by `hidden_norm`; `e_proj` of the normed
    embedding is added to every stream's `h_proj`; the block's layers have hyper-connections,
    and the depth has a hyper head of its own before its final norm."""

    def __init__(self, items: list[Item], args: HybridModelArgs) -> None:
        super().__init__()
        self.hidden_norm = model_norm(args)
        self.embedding_norm = model_norm(args)
        if args.hc_mult:
            self.e_proj = nn.Linear(args.dim, args.dim, bias=False)
            self.h_proj = nn.Linear(args.dim, args.dim, bias=False)
        else:
            self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = HybridStack(items, args)
        self.hc_head = (HyperHead(args.dim, args.hc_mult, eps=args.hc_eps,
                                  norm_eps=args.norm_eps) if args.hc_mult else None)
        self.final_norm = model_norm(args)

    def forward(self, previous, future_embedding, aux_loss, layout):
        """`previous`: the previous depth's normed output, or its streams with
        hyper-connections. Returns (this depth's output after its final norm: the LM head's
        input, what the next depth reads, aux loss)."""
        embedding = self.embedding_norm(future_embedding)
        if self.hc_head is None:
            x = self.eh_proj(torch.cat((embedding, self.hidden_norm(previous)), -1))
        else:
            x = self.e_proj(embedding).unsqueeze(2) + self.h_proj(self.hidden_norm(previous))
        x, aux_loss = self.block(x, aux_loss, layout)
        # The final norm runs here, inside this depth's FSDP unit, where its weight is gathered.
        if self.hc_head is None:
            normed = self.final_norm(x)
            return normed, normed, aux_loss
        return self.final_norm(self.hc_head(x)), x, aux_loss

    def init_weights(self, *, init_std: float, out_std: float) -> None:
        for norm in (self.hidden_norm, self.embedding_norm, self.final_norm):
            norm.init_weights()
        projections = ((self.eh_proj,) if self.hc_head is None else (self.e_proj, self.h_proj))
        for projection in projections:
            nn.init.trunc_normal_(projection.weight, std=init_std, a=-3 * init_std,
                                  b=3 * init_std)
        self.block.init_weights(init_std=init_std, out_std=out_std)
        if self.hc_head is not None:
            self.hc_head.init_weights(init_std=init_std)


UnitInitContext = Callable[[nn.Module], contextlib.AbstractContextManager]


def _plain_init(unit: nn.Module) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class HybridModel(nn.Module):
    def __init__(self, model_args: HybridModelArgs, *,
                 init_materializer: UnitInitContext = _plain_init) -> None:
        """`init_materializer(unit)`: the context each unit's init runs in. Parallel code
        builds the model with one that lets the init run on full tensors
        (titan_hybrid.parallel.init); model code itself stays single-device."""
        super().__init__()
        self.init_materializer = init_materializer
        model_args.validate()
        self.model_args = model_args
        pattern = model_args.parsed_pattern
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = HybridStack(pattern.main, model_args,
                                  hash_routed=model_args.hash_routed(pattern.main)).layers
        self.hc_head = (HyperHead(model_args.dim, model_args.hc_mult, eps=model_args.hc_eps,
                                  norm_eps=model_args.norm_eps) if model_args.hc_mult else None)
        self.norm = model_norm(model_args)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.enable_weight_tying:
            self.tie_weights()
            self.register_state_dict_post_hook(_without_tied_head)
            self.register_load_state_dict_pre_hook(_tied_head_from_embedding)
        self.mtp = nn.ModuleList(MTPDepth(pattern.mtp, model_args)
                                 for _ in range(pattern.mtp_depths))
        self.has_aux_loss = model_args.has_aux_loss
        self.mtp_depths = pattern.mtp_depths
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def tie_weights(self) -> None:
        """With enable_weight_tying, the head's weight is the embedding's Parameter (again:
        `to_empty`, or tensor parallelism's distribution of the two modules, gives each its
        own)."""
        if (self.model_args.enable_weight_tying and self.output is not None
                and self.tok_embeddings is not None):
            self.output.weight = self.tok_embeddings.weight

    def _rope_table(self) -> torch.Tensor:
        args = self.model_args
        return rotary_tables(head_dim=args.attention.rotary_dim, max_seq_len=args.max_seq_len,
                             theta=args.attention.rope_theta)

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """The buffers no checkpoint holds, which a model built on the meta device lacks: the
        rotary table, and the layers' statistics (zero until a step counts into them). The
        head is tied to the embedding again: `to_empty` gave each a tensor of its own."""
        self.tie_weights()
        with torch.device(buffer_device or self.rope.device):
            self.rope = self._rope_table()
        held = self.state_dict().keys()
        for name, buffer in self.named_buffers():
            if name != "rope" and name not in held:
                buffer.zero_()

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Each unit draws from its own generator seeded by (init_seed, unit name), so the weights
        do not depend on which other units exist (pipeline stages) or how they are sharded."""
        args = self.model_args
        self.init_buffers(buffer_device)
        # Output projections of residual branches shrink with depth (GPT-2 / Megatron scaling)
        # so the residual stream's variance does not grow with the number of layers.
        num_layers = args.parsed_pattern.num_physical_layers
        stds = {"init_std": args.init_std, "out_std": args.init_std / math.sqrt(2 * max(1, num_layers))}
        units = [("tok_embeddings", self.tok_embeddings,
                  lambda m: nn.init.normal_(m.weight))]
        units += [(f"layers.{key}", layer, lambda m: m.init_weights(**stds))
                  for key, layer in self.layers.items()]
        units += [(f"mtp.{i}", depth, lambda m: m.init_weights(**stds))
                  for i, depth in enumerate(self.mtp)]
        units += [("hc_head", self.hc_head, lambda m: m.init_weights(init_std=args.init_std))]
        units += [("norm", self.norm, lambda m: m.init_weights())]
        cutoff = 3 / math.sqrt(args.dim)
        # A tied weight takes the head's init, after the embedding's (torchtitan's Qwen3).
        units += [("output", self.output, lambda m: nn.init.trunc_normal_(
            m.weight, std=args.dim**-0.5, a=-cutoff, b=cutoff))]
        for name, unit, init in units:
            if unit is None:  # dropped by a pipeline split
                continue
            with torch.random.fork_rng(), self.init_materializer(unit):
                torch.manual_seed(args.init_seed * 1_000_003 + zlib.crc32(name.encode()))
                init(unit)

    def forward(self, tokens_or_hidden: torch.Tensor, *carried: torch.Tensor,
                positions: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None):
        """Tokens [B, T] -> logits, or (logits, aux_loss, *mtp_logits) with MoE layers or MTP.

        `positions` / `seq_idx` [B, T] describe packed documents and context-parallel shards
        (see model/layout.py); without them each row is one document in order. `token_ids`
        [B, T]: the batch's tokens, for a pipeline stage without the embedding whose MoE layers
        route by hash (the first stage takes its input tokens).

        Pipeline stages are copies of this model with the parts of other stages set to None (or
        dropped from `layers` / `mtp`). A stage without the embedding receives what the stage
        before returned: the hidden state, then the aux loss (MoE patterns), then the embeddings
        of the tokens 1..depths ahead that the MTP depths on the last stage read (they are
        computed on the first stage, where the embedding lives, and ride along)."""
        if self.tok_embeddings is not None:
            tokens = tokens_or_hidden
            h = self.tok_embeddings(tokens)
            if self.model_args.embedding_multiplier != 1.0:
                h = h * self.model_args.embedding_multiplier
            if self.model_args.hc_mult:
                h = expand_streams(h, self.model_args.hc_mult)
            # Depth k sees the embedding of token t+k; the last k positions have no such token
            # (their targets are ignored by the loss), so they read a padding token 0.
            futures = [self.tok_embeddings(F.pad(tokens[:, depth:], (0, depth)))
                       for depth in range(1, self.mtp_depths + 1)]
            # A leaf that requires grad, so that every stage's aux output does (a pipeline
            # stage sends gradients for all of its outputs).
            aux_loss = torch.zeros((), device=h.device,
                                   requires_grad=self.has_aux_loss and torch.is_grad_enabled())
        else:
            h = tokens_or_hidden
            # A view, not the received tensor: a stage with no aux-loss layer returns it as it
            # came, and torch 2.11's last stage detaches its outputs in place after their
            # backward, which would leave the receive buffer (reused by the next step) without
            # requires_grad, so no gradient would flow to the stage before.
            aux_loss = (carried[0].view_as(carried[0]) if self.has_aux_loss
                        else h.new_zeros((), dtype=torch.float32))
            futures = list(carried[1:] if self.has_aux_loss else carried)
        if self.tok_embeddings is not None:
            token_ids = tokens  # hash-routed MoE layers choose by them (later stages: kwarg)
        layout = TokenLayout(positions=positions, seq_idx=seq_idx, rope_table=self.rope,
                             token_ids=token_ids)
        for layer in self.layers.values():
            h, aux_loss = layer(h, aux_loss, layout)
        if self.output is None:  # a pipeline stage before the last
            carry = ([aux_loss] if self.has_aux_loss else []) + futures
            return (h, *carry) if carry else h
        normed = self.norm(h if self.hc_head is None else self.hc_head(h))
        logits = self._logits(normed)
        if not self.mtp_depths and not self.has_aux_loss:
            return logits
        mtp_logits = []
        previous = normed if self.hc_head is None else h  # V4's MTP reads the streams
        for mtp_depth, future in zip(self.mtp, futures, strict=True):
            normed, previous, aux_loss = mtp_depth(previous, future, aux_loss, layout)
            mtp_logits.append(self._logits(normed))
        if aux_loss.requires_grad:
            # Not the last unit's as it came: hooks around a unit may hand its outputs on as
            # views (EP overlap's backward markers, parallel/ep_overlap.py), and a root that
            # returned one would return a view (FSDP2 warns, as for HybridLayer's).
            aux_loss = aux_loss.clone()
        return (logits, aux_loss, *mtp_logits)

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.output(normed)
        scaling, multiplier = self.model_args.logits_scaling, self.model_args.lm_head_multiplier
        if multiplier != 1.0:
            logits = logits * multiplier
        return logits if scaling == 1.0 else logits / scaling


# A tied model's state dict holds its one weight once, as the embedding's; a state dict that
# gives the head a weight of its own is refused rather than loaded over the embedding.
TIED_HEAD_KEY, EMBEDDING_KEY = "output.weight", "tok_embeddings.weight"


def _without_tied_head(module, state_dict, prefix, local_metadata) -> None:
    state_dict.pop(prefix + TIED_HEAD_KEY, None)


def _tied_head_from_embedding(module, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
    """The head loads the embedding's tensor (the copy of the state dict that
    `load_state_dict` hands its modules)."""
    if prefix + TIED_HEAD_KEY in state_dict:
        error_msgs.append(f"'{prefix}{TIED_HEAD_KEY}': the model ties its LM head to its "
                          f"embedding (enable_weight_tying), whose weight is "
                          f"'{prefix}{EMBEDDING_KEY}'; this state dict has a head of its own")
    elif prefix + EMBEDDING_KEY in state_dict:
        state_dict[prefix + TIED_HEAD_KEY] = state_dict[prefix + EMBEDDING_KEY]


def routed_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The routed experts of every layer whose kind has them (LayerKind.routed_experts), by
    their modules' FQNs."""
    found = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, HybridLayer):
            continue
        for kind, mixer in layer.mixers():
            if kind.routed_experts is not None:
                prefix = f"{name}.{kind.name}" if name else kind.name
                found[f"{prefix}.{kind.routed_experts}"] = getattr(mixer, kind.routed_experts)
    return found
