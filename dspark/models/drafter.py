"""The DSpark drafter: a parallel backbone plus a tiny sequential head (docs/design.md section 3).

Glossary
- target features: hidden states of m chosen target layers l_1..l_m for every context token,
  concatenated: [num_tokens, m * hidden_size]. Fused as `H_ctx = hidden_norm(fc(features))` and
  injected into every layer as extra keys and values (`dspark.models.drafter_layers`), kept per
  request in a `ContextKVCache` (`dspark.models.context_kv_cache`).
- anchor x_0: the last token already produced (the previous round's bonus token), at position a.
  Its target features do not exist yet, so block positions see only context positions < a.
- block: gamma input positions at positions a..a+gamma-1 = embedding of x_0, then gamma-1 copies of
  the embedding of `mask_token_id`; attention inside the block is bidirectional. Block position k
  (1-based) emits h_k and base logits `U_k = lm_head(norm(h_k))` and predicts x_k, through the
  sequential head and with a confidence c_k (`dspark.models.sequential_heads`), sampled exactly
  (`dspark.models.draft_sampling`) into a `DraftBlock` (`dspark.models.draft_types`).
- reduced draft vocabulary (optional): the LM head is restricted to `draft_vocab_size` target ids
  (`draft_to_target`, ascending); tokens outside it have p^d = 0, so the distribution stays exact.
  W1 stays indexed by target ids (any real token can precede a draft position).

The token embedding and the LM head are the target's, passed in and frozen: they are buffers here,
not parameters, and never part of the drafter's checkpoint.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.context_kv_cache import ContextKVCache, RequestContext, gather_padded
from dspark.models.draft_graph_runner import DraftGraphRunner
from dspark.models.draft_processing import DraftProcessing
from dspark.models.draft_sampling import (PositionSample, RowPlan, assemble_blocks,
                                          draft_uniforms, plan_rows, position_noise,
                                          sample_block_position)
from dspark.models.draft_types import (BlockTrainOutputs, DraftBlock, DraftRequest,
                                       positions_to_draft)
from dspark.models.drafter_config import DrafterConfig, SequentialHead
from dspark.models.drafter_layers import DrafterLayer, rope_cos_sin
from dspark.models.packed_linear import pack_linears, pack_weight, packed_linear, packing_available
from dspark.models.quantized_linear import block_linear
from dspark.models.sequential_heads import ConfidenceHead, MarkovHead, RNNHead
from dspark.models.transformer import RMSNorm

if TYPE_CHECKING:
    from dspark.calibration.sts_map import CalibrationSet


class FrozenTargetHead(nn.Module):
    """Shared plumbing of the drafters: the target's frozen embedding and LM head as buffers, and
    the optional reduced draft vocabulary (draft id -> target id, ascending)."""

    config: DrafterConfig
    fc: nn.Linear

    def _init_target_buffers(self) -> None:
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        self.register_buffer("lm_head_weight", torch.empty(0), persistent=False)
        self.register_buffer("draft_to_target", torch.empty(0, dtype=torch.int64), persistent=False)
        self.register_buffer("target_to_draft", torch.empty(0, dtype=torch.int64), persistent=False)

    def set_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                           draft_token_ids: torch.Tensor | None = None) -> None:
        """The target's embedding [V, hidden] and LM head [V, hidden] (frozen, shared), and the
        draft vocabulary (ascending target ids [V_d]) when it is reduced."""
        cfg = self.config
        self.packed_lm_head = None  # packed from the old weights, if packed: pack again
        graphs = getattr(self, "round_graphs", None)
        if graphs is not None:
            graphs.clear()  # captured over the old weights
        self.lm_head_blocks = None  # the same for the Q8_0 blocks (drafter_block_weights)
        assert embed_weight.shape == (cfg.vocab_size, cfg.hidden_size), embed_weight.shape
        assert lm_head_weight.shape == (cfg.vocab_size, cfg.hidden_size), lm_head_weight.shape
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.embed_weight = embed_weight.detach().to(device=device, dtype=dtype)
        if cfg.draft_vocab_size is None:
            assert draft_token_ids is None or draft_token_ids.numel() == cfg.vocab_size
            self.lm_head_weight = lm_head_weight.detach().to(device=device, dtype=dtype)
            self.draft_to_target = torch.empty(0, dtype=torch.int64, device=device)
            self.target_to_draft = torch.empty(0, dtype=torch.int64, device=device)
            return
        if draft_token_ids is None:
            raise ValueError("a reduced draft vocabulary needs draft_token_ids")
        ids = draft_token_ids.to(device=device, dtype=torch.int64)
        assert ids.shape == (cfg.draft_vocab_size,), ids.shape
        if not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= cfg.vocab_size:
            raise ValueError("draft_token_ids must be strictly ascending target ids")
        self.draft_to_target = ids
        t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.int64, device=device)
        t2d[ids] = torch.arange(ids.numel(), device=device)
        self.target_to_draft = t2d
        self.lm_head_weight = lm_head_weight.detach().to(device=device)[ids].to(dtype)

    @property
    def draft_vocab_size(self) -> int:
        return self.config.effective_draft_vocab_size

    def _check_ready(self) -> None:
        if self.embed_weight.numel() == 0:
            raise RuntimeError("call set_target_weights(embed, lm_head) before using the drafter")

    def base_logits(self, hn: torch.Tensor) -> torch.Tensor:
        """U = lm_head(norm(h)): [..., hidden] -> [..., V_d] float32."""
        blocks = getattr(self, "lm_head_blocks", None)  # Q8_0: dspark.models.drafter_block_weights
        if blocks is not None:
            return block_linear(hn, blocks)
        packed = getattr(self, "packed_lm_head", None)
        if packed is not None:
            return packed_linear(hn, packed, None).float()
        return F.linear(hn, self.lm_head_weight).float()

    def pack_for_inference(self) -> None:
        """Multiply with oneDNN-packed weights from now on (a CPU, float32 or bf16 where oneDNN
        supports it; see `dspark.models.packed_linear`): every nn.Linear, the (draft-vocabulary)
        LM head, and the attention's q/k/v and the MLP's gate/up fused into one product each.
        Inference only; a no-op elsewhere. Call after `set_target_weights`."""
        self._check_ready()
        if not packing_available(self.lm_head_weight.device, self.lm_head_weight.dtype):
            return
        pack_linears(self)
        self.packed_lm_head = pack_weight(self.lm_head_weight)
        for module in self.modules():  # q/k/v and gate/up: one product each (drafter_layers)
            if hasattr(module, "pack_fused"):
                module.pack_fused()


class ContextAttention(Enum):
    """How the drafter's layers attend to the requests' cached contexts when drafting."""

    BATCHED = "batched"
    """One SDPA call per layer for all requests: the contexts gathered side by side, padded and
    masked (`context_kv_cache.gather_padded`), once per draft call."""
    PER_REQUEST = "per_request"
    """One SDPA call per request per layer, each context read in place: the reference."""

    @staticmethod
    def for_device(device: torch.device) -> "ContextAttention":
        """The default: PER_REQUEST on a CPU, where a call costs little and the padded copy of
        every context a round more (bench/draft_step.py, docs/results/drafter_attention.md);
        BATCHED elsewhere, where each call is kernel launches."""
        return ContextAttention.PER_REQUEST if device.type == "cpu" else ContextAttention.BATCHED


class DSparkDrafter(FrozenTargetHead):
    """DFlash-style parallel backbone + sequential head + confidence head (docs/design.md section 3).

    Parameters carry DeepSpec's tensor names (see `dspark.models.drafter_io`). The target's
    embedding and LM head are frozen buffers set with `set_target_weights`.
    """

    def __init__(self, config: DrafterConfig, embed_weight: torch.Tensor | None = None,
                 lm_head_weight: torch.Tensor | None = None,
                 draft_token_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.gamma = config.block_size
        d = config.hidden_size
        self.fc = nn.Linear(config.num_context_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        head = config.markov_head_type
        self.markov_head: MarkovHead | RNNHead | None = (
            MarkovHead(config) if head == SequentialHead.MARKOV
            else RNNHead(config) if head == SequentialHead.RNN else None)
        self.confidence_head = (ConfidenceHead(config.confidence_input_size)
                                if config.enable_confidence_head else None)
        self._conf_with_w1 = bool(config.confidence_head_with_markov and self.markov_head is not None)
        self.reset_parameters()
        # Frozen target tensors and the draft-vocabulary map: buffers, not in the checkpoint.
        self._init_target_buffers()
        # STS fits applied to the confidences, one row per sampling temperature calibrated at
        # (set_confidence_calibration); one identity row until then.
        self.register_buffer("confidence_temperatures", torch.ones(1, self.gamma), persistent=False)
        self.register_buffer("confidence_biases", torch.zeros(1, self.gamma), persistent=False)
        self._calibration_sampling_temps: list[float] = []  # [num_fits] when num_fits > 1
        self._cache = ContextKVCache()
        self.context_attention: ContextAttention | None = None
        """How drafting attends to the cached contexts; None: by the device (`ContextAttention`)."""
        self.round_graphs: DraftGraphRunner | None = None
        """The drafting round over static per-bucket buffers (`use_round_graphs`); None: eager."""
        # Context tokens not yet projected into the cache, per request: (features [n, m * hidden],
        # positions [n]) in arrival order (see append_context).
        self._pending: dict[Hashable, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        if embed_weight is not None and lm_head_weight is not None:
            self.set_target_weights(embed_weight, lm_head_weight, draft_token_ids)

    # ---- set-up ------------------------------------------------------------------------------

    def reset_parameters(self, std: float = 0.02) -> None:
        """DeepSpec/HF-style init; W2 = 0 so training starts from the pure parallel drafter."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.markov_head is not None:
            nn.init.zeros_(self.markov_head.markov_w2.weight)

    def set_confidence_temperatures(self, temperatures: Sequence[float] | torch.Tensor,
                                    biases: Sequence[float] | torch.Tensor | None = None) -> None:
        """One STS fit for every request: c_k = sigmoid(logit(c_k) / T_k + b_k) (b_k default 0)."""
        t = torch.as_tensor(temperatures, dtype=torch.float32, device=self.fc.weight.device)
        assert t.shape == (self.gamma,) and bool((t > 0).all()), t
        b = (torch.zeros_like(t) if biases is None
             else torch.as_tensor(biases, dtype=torch.float32, device=t.device))
        assert b.shape == (self.gamma,) and bool(torch.isfinite(b).all()), b
        self.confidence_temperatures = t.unsqueeze(0)  # [1, gamma]
        self.confidence_biases = b.unsqueeze(0)  # [1, gamma]
        self._calibration_sampling_temps = []

    def set_confidence_calibration(self, calibration: CalibrationSet) -> None:
        """STS fits per sampling temperature (dspark.calibration.sts_map.CalibrationSet): each request's
        confidences use the fit of the sampling temperature nearest its own."""
        if calibration.gamma != self.gamma:
            raise ValueError(f"calibration has gamma={calibration.gamma}, the drafter {self.gamma}")
        device = self.fc.weight.device
        self.confidence_temperatures = torch.tensor(
            [f.temperatures for f in calibration.fits], dtype=torch.float32, device=device)
        self.confidence_biases = torch.tensor(
            [f.biases for f in calibration.fits], dtype=torch.float32, device=device)
        self._calibration_sampling_temps = ([f.sampling_temperature for f in calibration.fits]
                                            if len(calibration.fits) > 1 else [])

    def _calibration_rows(self, requests: Sequence[DraftRequest]) -> torch.Tensor | None:
        """Row of confidence_temperatures for each request [R] (None: the single row 0)."""
        temps = self._calibration_sampling_temps
        if not temps:
            return None
        rows = [min(range(len(temps)), key=lambda i: (abs(temps[i] - r.sampling.temperature), i))
                for r in requests]
        return torch.tensor(rows, dtype=torch.int64, device=self.confidence_temperatures.device)

    def use_round_graphs(self, enabled: bool | None = None) -> None:
        """Draft over static per-bucket buffers (`dspark.models.draft_graph_runner`), captured as
        CUDA graphs on CUDA and run eagerly elsewhere; enabled None: on for CUDA, off elsewhere
        (a CPU gains nothing from the padding and the context copies). False: the eager path.
        Call after `set_target_weights` (which drops graphs captured over the old weights)."""
        device = self.fc.weight.device
        if enabled is None:
            enabled = device.type == "cuda"
        self.round_graphs = DraftGraphRunner(self, device.type == "cuda") if enabled else None

    # ---- the parallel backbone ---------------------------------------------------------------

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., m * hidden] -> H_ctx [..., hidden]."""
        assert features.shape[-1] == self.fc.in_features, (features.shape, self.fc.in_features)
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, L, m * hidden], positions [B, L] -> keys, values
        [num_layers, B, num_kv_heads, L, head_dim]."""
        keys, values, _ = self.context_states(features, positions)
        return keys, values

    def context_states(self, features: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """features [B, L, m * hidden], positions [B, L] -> keys, values
        [num_layers, B, num_kv_heads, L, head_dim] and H_ctx [B, L, hidden]."""
        h_ctx = self.fuse_context(features)  # [B, L, hidden]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h_ctx.dtype)
        ks, vs = zip(*(layer.self_attn.project_kv(h_ctx, cos, sin) for layer in self.layers))
        return torch.stack(ks), torch.stack(vs), h_ctx

    def backbone(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                 ctx_keys: torch.Tensor, ctx_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """block_embeds [B, Q, hidden], block_positions [B, Q], ctx_keys/values
        [num_layers, B, num_kv_heads, L, head_dim], mask [B, Q, L + Q] -> norm(h) [B, Q, hidden]."""
        x = block_embeds.to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(block_positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, ctx_keys[i], ctx_values[i], mask)
        return self.norm(x)

    def _confidence_logits(self, hn: torch.Tensor, w1_prev: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        feats = hn if not self._conf_with_w1 else torch.cat([hn, w1_prev.to(hn.dtype)], dim=-1)
        return self.confidence_head(feats).float()

    # ---- training: many blocks per sequence, teacher forced ------------------------------------

    def forward_train(self, input_ids: torch.Tensor, features: torch.Tensor,
                      anchors: torch.Tensor, labels: torch.Tensor) -> BlockTrainOutputs:
        """Teacher-forced block outputs for N anchors per sequence.

        input_ids [B, T]; features [B, T, m * hidden] (target features of every position);
        anchors [B, N] anchor positions a (block k sees context positions < a);
        labels [B, N, gamma] the true x*_{a+1..a+gamma} (any valid id where out of range).
        """
        self._check_ready()
        B, T = input_ids.shape
        N, gamma = anchors.shape[1], self.gamma
        assert features.shape[:2] == (B, T), (features.shape, B, T)
        assert labels.shape == (B, N, gamma), labels.shape
        device = input_ids.device
        positions = torch.arange(T, device=device).expand(B, T)
        ctx_k, ctx_v, h_ctx = self.context_states(features, positions)
        anchor_tokens = input_ids.gather(1, anchors)  # [B, N]
        block_ids = torch.full((B, N, gamma), self.config.mask_token_id, dtype=torch.int64,
                               device=device)
        block_ids[:, :, 0] = anchor_tokens
        embeds = F.embedding(block_ids.view(B, N * gamma), self.embed_weight)  # [B, N*gamma, hidden]
        if self.config.inject_last_context:
            last = h_ctx.gather(1, (anchors - 1).clamp(min=0).unsqueeze(-1).expand(
                B, N, h_ctx.shape[-1]))  # [B, N, hidden]: H_ctx at a - 1
            last = last * (anchors > 0).unsqueeze(-1).to(last.dtype)  # no context before a = 0
            embeds = (embeds.view(B, N, gamma, -1) + last.unsqueeze(2)).view(B, N * gamma, -1)
        offsets = torch.arange(gamma, device=device)
        block_pos = (anchors.unsqueeze(-1) + offsets).view(B, N * gamma)
        mask = training_mask(anchors, T, gamma)  # [B, N*gamma, T + N*gamma]
        hn = self.backbone(embeds, block_pos, ctx_k, ctx_v, mask).view(B, N, gamma, -1)
        logits = self.base_logits(hn)  # [B, N, gamma, V_d]
        prev_ids = torch.cat([anchor_tokens.unsqueeze(-1), labels[..., :-1]], dim=-1)  # [B, N, gamma]
        w1_prev = None
        if self.markov_head is not None:
            bias, w1_prev = self.markov_head.block_bias(prev_ids, hn)
            logits = logits + bias.float()
        return BlockTrainOutputs(logits, self._confidence_logits(hn, w1_prev))

    # ---- inference: per-request context cache and batched drafting ------------------------------

    def append_context(self, request_id: Hashable, features: torch.Tensor,
                       positions: torch.Tensor, token_ids: torch.Tensor | None = None) -> None:
        """Add context tokens' target features [n, m * hidden] at absolute positions [n].
        (token_ids is accepted for interface parity with the Eagle-style drafter; unused.)

        Lazy: the tokens are projected into the context cache when the request is next drafted
        (`_absorb_pending`), together with every other pending token of that draft call, in one
        product per weight instead of one per request and round; a round that skips drafting
        then costs the drafter nothing. Each token's projection depends on that token alone, so
        the result is the same up to float summation order."""
        assert features.dim() == 2 and positions.shape == (features.shape[0],), (
            features.shape, positions.shape)
        if features.shape[0] == 0:
            return
        self._pending.setdefault(request_id, []).append((features, positions))

    def _absorb_pending(self, request_ids: Sequence[Hashable]) -> None:
        """Project the pending context tokens of these requests into the cache, all at once."""
        pieces = [(rid, piece) for rid in dict.fromkeys(request_ids)
                  for piece in self._pending.pop(rid, ())]
        if not pieces:
            return
        device = self.fc.weight.device
        features = torch.cat([f for _, (f, _) in pieces]).to(device)  # [N, m * hidden]
        host_positions = torch.cat([p for _, (_, p) in pieces]).to(torch.int64)  # [N]
        positions = host_positions.to(device, non_blocking=True)  # [N]
        with torch.no_grad():
            # keys, values [num_layers, 1, num_kv_heads, N, head_dim]; h_ctx [1, N, hidden]
            keys, values, h_ctx = self.context_states(features.unsqueeze(0), positions.unsqueeze(0))
        start = 0
        for rid, (f, _) in pieces:
            end = start + f.shape[0]
            hidden = h_ctx[0, start:end] if self.config.inject_last_context else None  # [n, hidden]
            self._cache.append(rid, keys[:, 0, :, start:end], values[:, 0, :, start:end],
                               positions[start:end], hidden, host_positions[start:end])
            start = end

    def release(self, request_id: Hashable) -> None:
        self._pending.pop(request_id, None)
        self._cache.release(request_id)

    def fork(self, parent_id: Hashable, child_id: Hashable, num_positions: int) -> None:
        """`child_id`'s context: `parent_id`'s context tokens at positions < num_positions,
        the projected ones copied and the pending ones pending for the child too (projecting
        them now would change the parent's float summation order)."""
        self._cache.fork(parent_id, child_id, num_positions)
        pieces = []
        for features, positions in self._pending.get(parent_id, ()):
            keep = positions < num_positions  # [n] on the host
            if bool(keep.all()):
                pieces.append((features, positions))
            elif bool(keep.any()):
                pieces.append((features[keep], positions[keep]))
        if pieces:
            self._pending[child_id] = pieces
        else:
            self._pending.pop(child_id, None)

    def context_length(self, request_id: Hashable) -> int:
        self._absorb_pending([request_id])
        return self._cache.length(request_id)

    def _last_context_states(self, contexts: Sequence[RequestContext],
                             requests: Sequence[DraftRequest]) -> torch.Tensor:
        """H_ctx at each request's last context position before its anchor: [R, hidden]
        (zeros where there is none, as in training at anchor 0)."""
        rows = []
        for ctx, req in zip(contexts, requests):
            row = ctx.last_hidden(req.anchor_position)
            rows.append(row if row is not None else
                        self.embed_weight.new_zeros(self.config.hidden_size))
        return torch.stack(rows)

    def block_input(self, anchor_tok: torch.Tensor, anchor_pos: torch.Tensor,
                    last_hidden: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks' input: anchor_tok/anchor_pos [R] int64, last_hidden [R, hidden] (H_ctx
        before each anchor, with inject_last_context) -> x [R, gamma, hidden] (embeddings of
        the anchor and gamma - 1 mask tokens), cos/sin [R, gamma, head_dim]."""
        cfg, gamma = self.config, self.gamma
        R = anchor_tok.shape[0]
        block_ids = torch.full((R, gamma), cfg.mask_token_id, dtype=torch.int64,
                               device=anchor_tok.device)
        block_ids[:, 0] = anchor_tok
        block_pos = anchor_pos.unsqueeze(1) + torch.arange(gamma, device=anchor_pos.device)  # [R, gamma]
        x = F.embedding(block_ids, self.embed_weight)  # [R, gamma, hidden]
        if cfg.inject_last_context:
            x = x + last_hidden.unsqueeze(1)
        cos, sin = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta, self.fc.weight.dtype)
        return x, cos, sin

    def padded_backbone(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                        anchor_pos: torch.Tensor) -> torch.Tensor:
        """The layers over the blocks x [R, gamma, hidden] with the contexts side by side:
        keys/values [num_layers, R, kv_heads, L + gamma, head_dim] (the last gamma slots receive
        the block's own), positions [R, L] (padding slots at a position no anchor reaches),
        anchor_pos [R]. Returns the last layer's x [R, gamma, hidden]."""
        R, gamma, _ = x.shape
        L = positions.shape[1]
        context_visible = positions < anchor_pos.unsqueeze(1)  # [R, L]: padding never is
        mask = torch.cat([context_visible.unsqueeze(1).expand(R, gamma, L),
                          context_visible.new_ones(R, gamma, gamma)], dim=2)  # [R, gamma, L + gamma]
        for i, layer in enumerate(self.layers):
            x = layer.forward_padded(x, cos, sin, keys[i], values[i], mask)
        return x

    def _cached_backbone(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         contexts: Sequence[RequestContext], requests: Sequence[DraftRequest],
                         anchor_pos: torch.Tensor) -> torch.Tensor:
        """The layers over the blocks x [R, gamma, hidden] (cos/sin [R, gamma, head_dim]) with
        each request's cached context (scratch slots reserved), by `context_attention`;
        anchor_pos [R] on the device. Returns the last layer's x [R, gamma, hidden]."""
        gamma = x.shape[1]
        mode = self.context_attention or ContextAttention.for_device(x.device)
        if mode is ContextAttention.PER_REQUEST:
            masks = [c.visibility(r.anchor_position, gamma) for c, r in zip(contexts, requests)]
            for i, layer in enumerate(self.layers):
                x = layer.forward_cached(x, cos, sin, contexts, i, masks)
            return x
        cfg = self.config
        # keys/values [num_layers, R, kv_heads, L_max + gamma, head_dim]; positions [R, L_max]
        keys, values, positions = gather_padded(contexts, len(self.layers), cfg.num_key_value_heads,
                                                cfg.head_dim, x.dtype, x.device, extra_slots=gamma)
        return self.padded_backbone(x, cos, sin, keys, values, positions, anchor_pos)

    def draw_positions(self, hn: torch.Tensor, base: torch.Tensor, anchor_tok: torch.Tensor,
                       plan: RowPlan, uniforms: torch.Tensor | None,
                       processing: DraftProcessing | None, n: int,
                       target_ids: torch.Tensor | None = None
                       ) -> tuple[list[PositionSample], torch.Tensor | None]:
        """The sequential head's chain over block positions 1..n: hn [R, >= n, hidden], base
        logits [R, >= n, V_d], anchor_tok [R] target ids, uniforms [R, gamma] (None: all
        greedy), target_ids [V_d] (for Gumbel noise; None where no row drafts by Gumbel-max).
        Returns the n positions' samples and W1[x_{k-1}] [R, n, r] (None without a Markov or
        RNN head)."""
        R = hn.shape[0]
        reduced = self.config.draft_vocab_size is not None
        prev = anchor_tok  # target ids
        state = (self.markov_head.initial_state((R,), hn)
                 if self.markov_head is not None else None)
        samples, w1_prevs = [], []
        for k in range(n):
            logits_k = base[:, k]  # [R, V_d]
            if self.markov_head is not None:
                logits_k, state, w1_prev = self.markov_head.add_bias(logits_k, prev, hn[:, k], state)
                w1_prevs.append(w1_prev)  # [R, r]: W1[x_{k-1}]
            if processing is not None:  # q is the processed distribution (draft_processing)
                logits_k = processing.apply(k, logits_k)
            u_k = None if uniforms is None else uniforms[:, k]
            sample = sample_block_position(logits_k, plan, u_k,
                                           position_noise(plan, k + 1, target_ids))
            samples.append(sample)
            prev = self.draft_to_target[sample.tokens] if reduced else sample.tokens
            if processing is not None:
                processing.advance(sample.tokens, prev)
        if processing is not None:
            processing.finish()
        return samples, (torch.stack(w1_prevs, dim=1) if w1_prevs else None)

    def calibrated_confidences(self, hn: torch.Tensor, w1_block: torch.Tensor | None,
                               conf_t: torch.Tensor, conf_b: torch.Tensor) -> torch.Tensor:
        """c_k for hn [R, n, hidden] and W1[x_{k-1}] [R, n, r], under the STS fits conf_t /
        conf_b ([gamma] or [R, gamma]): [R, n] float32 (NaN without a confidence head).

        c_k reads norm(h_k) and W1[x_{k-1}], never x_k: one product for every position, after
        the chain that drew them, instead of one a position."""
        R, n = hn.shape[:2]
        conf_logits = self._confidence_logits(hn, w1_block)  # [R, n]
        if conf_logits is None:
            return torch.full((R, n), float("nan"), device=hn.device)
        return torch.sigmoid(conf_logits / conf_t[..., :n] + conf_b[..., :n])

    @torch.no_grad()
    def draft(self, requests: Sequence[DraftRequest], sparse_top_k: int | None = None,
              num_positions: int | None = None) -> list[DraftBlock]:
        """Draft one block for each request in one backbone pass.

        sparse_top_k: if set, every sampled request draws from its top-k-truncated distribution
        and gets it back sparse (lossless: p^d is reported exactly). Greedy requests are always
        returned sparse with k = 1; requests with a top_k sampling parameter are sparse too.
        num_positions: sample only the first n positions (the LM head and the sequential head
        run n times instead of gamma). The backbone still runs over the whole block, whose input
        (anchor + masks) every position attends to, so the n positions are exactly those of the
        whole block; each request's generator advances by gamma uniforms either way.

        With `round_graphs` set and at most the largest batch bucket of requests, the round runs
        over its static buffers (`dspark.models.draft_graph_runner`: CUDA graphs on CUDA).
        """
        self._check_ready()
        if not requests:
            return []
        cfg, gamma = self.config, self.gamma
        n = positions_to_draft(num_positions, gamma)
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        R = len(requests)
        self._absorb_pending([r.request_id for r in requests])
        contexts = []
        for r in requests:  # a request with no context yet gets an empty, unstored one
            ctx = self._cache.get(r.request_id) or RequestContext(
                len(self.layers), cfg.num_key_value_heads, cfg.head_dim, dtype, device, gamma,
                cfg.hidden_size if cfg.inject_last_context else 0)
            ctx.reserve(ctx.length + gamma)
            contexts.append(ctx)
        plan = plan_rows(requests, self.draft_vocab_size, sparse_top_k, device)
        reduced = cfg.draft_vocab_size is not None
        target_ids = (self.draft_to_target if reduced  # [V_d]: the target id of each draft id
                      else torch.arange(self.draft_vocab_size, device=device))
        processing = DraftProcessing.plan(requests, self.target_to_draft if reduced else None,
                                          target_ids, device)
        rows = self._calibration_rows(requests)
        conf_t = self.confidence_temperatures[0 if rows is None else rows]  # [gamma] or [R, gamma]
        conf_b = self.confidence_biases[0 if rows is None else rows]
        last_hidden = (self._last_context_states(contexts, requests)  # [R, hidden]
                       if cfg.inject_last_context else None)

        graphs = self.round_graphs
        if graphs is not None and graphs.fits(R):
            greedy_chain = plan.all_greedy and processing is None
            out = graphs.run(contexts, [r.anchor_token for r in requests],
                             [r.anchor_position for r in requests], last_hidden, conf_t, conf_b,
                             greedy_chain, n)
            if greedy_chain:
                ones = out.confidences.new_ones(R, 1)
                samples = [PositionSample(out.tokens[:, k], out.tokens[:, k: k + 1], ones, None)
                           for k in range(n)]
                return assemble_blocks(plan, samples, out.confidences,
                                       self.draft_to_target if reduced else None)
            hn, base, anchor_tok = out.hn[:, :n], out.base[:, :n], out.anchor_tokens
        else:
            anchor_tok = torch.tensor([r.anchor_token for r in requests], dtype=torch.int64,
                                      device=device)
            anchor_pos = torch.tensor([r.anchor_position for r in requests], dtype=torch.int64,
                                      device=device)
            x, cos, sin = self.block_input(anchor_tok, anchor_pos, last_hidden)
            x = self._cached_backbone(x, cos, sin, contexts, requests, anchor_pos)
            hn = self.norm(x)[:, :n]  # [R, n, hidden]
            base = self.base_logits(hn)  # [R, n, V_d]

        uniforms = None if plan.all_greedy else draft_uniforms(requests, gamma, device)  # [R, gamma]
        samples, w1_block = self.draw_positions(hn, base, anchor_tok, plan, uniforms, processing,
                                                n, target_ids)
        confidences = self.calibrated_confidences(hn, w1_block, conf_t, conf_b)  # [R, n]
        return assemble_blocks(plan, samples, confidences,
                               self.draft_to_target if reduced else None)


def training_mask(anchors: torch.Tensor, seq_len: int, gamma: int) -> torch.Tensor:
    """Attention mask for N blocks per sequence: anchors [B, N] -> [B, N*gamma, T + N*gamma] bool.

    A block query sees context position j iff j < its anchor, and every position of its own block
    (bidirectional), nothing of other blocks.
    """
    B, N = anchors.shape
    device = anchors.device
    q_block = torch.arange(N * gamma, device=device) // gamma  # [Q]
    q_anchor = anchors[:, q_block]  # [B, Q]
    ctx = torch.arange(seq_len, device=device).view(1, 1, -1) < q_anchor.unsqueeze(-1)  # [B, Q, T]
    same = q_block.view(-1, 1) == q_block.view(1, -1)  # [Q, Q]
    return torch.cat([ctx, same.unsqueeze(0).expand(B, -1, -1)], dim=2)
