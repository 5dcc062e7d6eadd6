"""A compact Llama / Qwen2 decoder that loads HuggingFace safetensors by their HuggingFace names (its
parameters and their loading: `parameters.py`).

Three entry points:
- `forward_logits(input_ids)`: a plain full-sequence forward without a cache (reference and tests).
- `prefill(input_ids, cache, slot)`, `prefill_packed(...)`: run prompts into KV-cache slots (hidden states);
  `prefill_packed` (what the engine runs) concatenates the sequences without padding and reads cached
  prefixes in place. `prefill_batch(...)`, the same right-padded, is its reference in tests and benchmarks.
- `decode(input_ids, positions, cache)`: one token for each of the first `B` slots, batched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl_engine import decode_attention, extend_attention
from asyncrl_engine import fused_kernels as fused
from asyncrl_engine.kv_cache import KVCache, PackedPrefill, PrefillReplay
from asyncrl_engine.model_config import ModelConfig, inverse_frequencies
from asyncrl_engine.parameters import EngineParameters


class EngineModel(EngineParameters):
    """The decoder. Parameters are plain tensors (no autograd) in fused layouts with HuggingFace-named views.

    Not thread-safe: the engine calls it from its one scheduler thread.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        fused_kernels: bool = True,
        attention_kernels: bool = True,
    ) -> None:
        super().__init__(config, device, dtype, fused_kernels, attention_kernels)
        c = config
        inv_freq = inverse_frequencies(c)
        self._inv_freq = inv_freq
        self._rope_cos = torch.empty(0, device=device)
        self._rope_sin = torch.empty(0, device=device)
        self.ensure_rope(c.max_position_embeddings)
        self.decode_kernel = attention_kernels and decode_attention.available(device)
        """Whether `decode` uses the Triton kernel that reads each row's KV up to its own length (requested,
        the default, and CUDA with Triton; set False to measure the masked SDPA it replaces)."""
        self.extend_kernel = attention_kernels and extend_attention.available(device)
        """Whether `prefill_packed` attends with the Triton kernel that reads each sequence's cached KV in
        place (requested, the default, and CUDA with Triton; set False to measure the per-sequence SDPA, its
        reference)."""
        self.fused_kernels = fused_kernels and fused.available(device)
        """Whether the forwards use the fused Triton kernels (`fused_kernels.py`: residual add + RMSNorm,
        rotary embedding + KV cache write, SiLU * up) instead of torch's elementwise ops: requested (the
        default) and available (CUDA with Triton, first launches equal to torch). Set it to switch paths."""

    # ---------------------------------------------------------------------------------------------- forward
    def ensure_rope(self, length: int) -> None:
        """Make the rope tables cover positions below `length`. Growing them allocates new tables, which a
        CUDA graph captured before does not see: graphs over a cache are captured after covering its
        capacity."""
        if self._rope_cos.shape[0] >= length:
            return
        positions = torch.arange(length, dtype=torch.float64)
        angles = torch.outer(positions, self._inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self._rope_cos = angles.cos().to(self.device, torch.float32)
        self._rope_sin = angles.sin().to(self.device, torch.float32)

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if self.fused_kernels:
            return fused.rms_norm(x, weight, self.config.rms_norm_eps)
        return fused.torch_rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(self, x: Tensor, residual: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, RMSNorm of it): one kernel when fused; without a residual, x and its norm."""
        if residual is None:
            return x, self._rms_norm(x, weight)
        if self.fused_kernels:
            return fused.add_rms_norm(x, residual, weight, self.config.rms_norm_eps)
        x = x + residual
        return x, fused.torch_rms_norm(x, weight, self.config.rms_norm_eps)

    def _project_qkv(self, layer: int, h: Tensor) -> Tensor:
        """The fused q|k|v projection [..., (heads + 2 kv_heads) * head_dim]."""
        return F.linear(h, self.qkv[layer], self.qkv_bias[layer])

    def _split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]

    def _rotary(
        self,
        qkv: Tensor,
        positions: Tensor,
        cache: tuple[Tensor, Tensor] | None = None,
        slots: Tensor | None = None,
        write_positions: Tensor | None = None,
    ) -> None:
        """The fused rotary kernel on q|k|v in place (and the K/V cache write); see `fused_kernels.rotary`."""
        c = self.config
        fused.rotary(
            qkv,
            positions,
            self._rope_cos,
            self._rope_sin,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            cache,
            slots,
            write_positions,
        )

    def _heads(self, qkv: Tensor, batch: int, length: int) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of a q|k|v projection [B, T, ...] as [B, heads, T, head_dim] views."""
        c = self.config
        q, k, v = self._split_qkv(qkv)
        return (
            q.view(batch, length, c.num_heads, c.head_dim).transpose(1, 2),
            k.view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2),
            v.view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2),
        )

    def _silu_mul(self, gate_up: Tensor) -> Tensor:
        if self.fused_kernels:
            return fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _layers(self, x: Tensor, attend: Callable[[int, Tensor], Tensor]) -> Tensor:
        """The decoder layers over the residual stream x [..., hidden]. `attend(layer, h)` maps the normed
        input to the attention's output [..., heads * head_dim] (before o_proj). Each residual add is done
        with the norm after it (one kernel when fused); the last layer's is done alone."""
        residual: Tensor | None = None
        for layer in range(self.config.num_layers):
            x, h = self._add_norm(x, residual, self.attn_norm[layer])
            attention = F.linear(attend(layer, h), self.o_proj[layer])
            x, h = self._add_norm(x, attention, self.mlp_norm[layer])
            residual = F.linear(self._silu_mul(F.linear(h, self.gate_up[layer])), self.down[layer])
        return x if residual is None else x + residual

    def logits(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head: hidden [..., hidden_size] -> float32 logits [..., vocab]."""
        return F.linear(self._rms_norm(hidden, self.final_norm), self.lm_head).float()

    @torch.inference_mode()
    def forward_logits(self, input_ids: Tensor) -> Tensor:
        """Full causal forward without a cache: input_ids LongTensor[T] -> float32 logits [T, vocab]."""
        hidden = self._forward_batch(input_ids.to(self.device).unsqueeze(0), cache=None, slots=None)
        return self.logits(hidden[0])

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, cache: KVCache, slot: int) -> Tensor:
        """Run input_ids [T] from position 0, write their KV into `slot`; return hidden states [T, hidden]."""
        return self._forward_batch(input_ids.to(self.device).unsqueeze(0), cache, [slot])[0]

    @torch.inference_mode()
    def prefill_batch(
        self,
        sequences: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
    ) -> Tensor:
        """Prefill several sequences at once, right-padded to the longest: returns hidden [B, T_max, hidden].
        (The engine runs `prefill_packed`; this is its reference, and what the benchmark compares it with.)

        Row b holds the tokens at positions `starts[b]..` (0 by default) of the sequence in `slots[b]`,
        whose KV before `starts[b]` is already in the cache (a prefix-cache hit); its queries attend over that
        cached KV and their own. Row b is valid up to len(sequences[b]); its valid positions never see the
        padding after them, and the K/V written for padding lands beyond the row's length (or, with a cached
        prefix, at the cache's last position, which no request uses), where later steps overwrite it.
        """
        longest = max(len(s) for s in sequences)
        padded = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, tokens in enumerate(sequences):
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if starts is None or not any(starts):
            return self._forward_batch(padded.to(self.device), cache, list(slots))
        return self._forward_extend(
            padded.to(self.device), [len(s) for s in sequences], cache, list(slots), list(starts)
        )

    @torch.inference_mode()
    def prefill_packed(
        self,
        sequences: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
        replay: PrefillReplay | None = None,
    ) -> Tensor:
        """Prefill several sequences as one packed batch: returns hidden states [N, hidden], N the total
        token count, sequence b's at rows `sum(len(s) for s in sequences[:b])..` (no padding anywhere).

        Sequence b holds the tokens at positions `starts[b]..` (0 by default) of the sequence in `slots[b]`,
        whose KV before `starts[b]` is already in the cache (a prefix-cache hit). Each token's K/V is written
        at (its slot, its position) and its query attends causally over its slot's positions up to its own,
        read in place: the extend kernel on CUDA (`extend_kernel`), one SDPA per sequence otherwise.
        `replay`: tried first (the engine's CUDA graphs of `forward_packed`); eager where it returns None.
        """
        batch = self.pack_prefill(sequences, cache, slots, starts)
        self.ensure_rope(batch.end)
        if replay is not None:
            hidden = replay(batch, cache)
            if hidden is not None:
                return hidden
        # Moved in one copy that does not wait for the device (a blocking copy would wait for the decode
        # step in flight beside which the engine admits).
        shape = batch.shape
        packed = batch.padded(shape, cache.capacity).to(self.device, non_blocking=True)
        return self.forward_packed(shape.columns(packed), cache, batch)

    def pack_prefill(
        self,
        sequences: Sequence[Sequence[int]],
        cache: KVCache,
        slots: Sequence[int],
        starts: Sequence[int] | None = None,
    ) -> PackedPrefill:
        """The host side of `prefill_packed`: its arguments checked against `cache`, as columns, with the
        extend kernel's work items when the model attends with it."""
        c = self.config
        per_program = (
            extend_attention.tokens_per_program(c.num_heads, c.num_kv_heads) if self.extend_kernel else None
        )
        return PackedPrefill.pack(sequences, cache, slots, starts, per_program)

    @property
    def packed_from_columns(self) -> bool:
        """Whether `forward_packed` runs from its device columns alone, as a CUDA graph replays it: the
        extend kernel and the fused kernels are on (the torch path reads the batch's host lists)."""
        return self.extend_kernel and self.fused_kernels

    def forward_packed(
        self, columns: Sequence[Tensor], cache: KVCache, batch: PackedPrefill | None
    ) -> Tensor:
        """The forward of a packed prefill: `columns` those of a `PackedPrefill` on the device, hidden states
        [N, hidden] for their N tokens. `batch` (the host side) is read by the torch path only; without it
        (a CUDA graph's static columns, padded to its bucket: tokens that no work item takes, sequences of
        no tokens, work items past every sequence) the extend kernel and the fused kernels must be on."""
        c = self.config
        (
            input_ids,
            positions,
            token_slots,
            slot_index,
            prefix_lengths,
            cu_seqlens,
            work_sequence,
            work_first,
        ) = columns
        total = input_ids.shape[0]
        fused_path = self.fused_kernels
        use_kernel = self.extend_kernel
        if batch is None and not self.packed_from_columns:
            raise ValueError("a packed prefill without its host side needs the extend and fused kernels")
        # [N, 1, D] each, for the torch path.
        rope = (
            None
            if fused_path
            else (self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1))
        )

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)  # [N, width]
            layer_keys, layer_values = cache.keys[layer], cache.values[layer]
            if fused_path:
                # One row of one token per token: its own slot and position.
                self._rotary(qkv, positions, (layer_keys, layer_values), token_slots)
                q = self._split_qkv(qkv)[0].view(total, c.num_heads, c.head_dim)
            else:
                assert rope is not None
                q, k, v = self._split_qkv(qkv)
                q = fused.torch_rotate(q.view(total, c.num_heads, c.head_dim), *rope)
                k = fused.torch_rotate(k.view(total, c.num_kv_heads, c.head_dim), *rope)
                layer_keys[token_slots, :, positions] = k
                layer_values[token_slots, :, positions] = v.view(total, c.num_kv_heads, c.head_dim)
            if use_kernel:
                attn = extend_attention.extend_attention(
                    q,
                    layer_keys,
                    layer_values,
                    slot_index,
                    prefix_lengths,
                    cu_seqlens,
                    work_sequence,
                    work_first,
                )
            else:
                assert batch is not None
                attn = extend_attention.torch_extend_attention(
                    q, layer_keys, layer_values, batch.slots, batch.starts, batch.lengths
                )
            return attn.reshape(total, -1)

        return self._layers(self.embed[input_ids], attend)

    def _prefill_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention of a prefill: causal (top-left aligned) without `mask`, else under the boolean `mask`.

        On CUDA the kernel is chosen here rather than by SDPA's heuristics: flash (or memory-efficient) for
        the causal case, memory-efficient with an explicit mask. Torch's default for these shapes is cuDNN,
        which plans every new (batch, length) shape at its first call (~60 ms on an H200), and prefill shapes
        under continuous batching are nearly always new.
        """
        if q.device.type != "cuda":
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if mask is None:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def _forward_batch(self, input_ids: Tensor, cache: KVCache | None, slots: list[int] | None) -> Tensor:
        """input_ids [B, T] from position 0 -> hidden states [B, T, hidden]; K/V go to `slots` of `cache`."""
        batch, length = input_ids.shape
        self.ensure_rope(length)
        cos, sin = self._rope_cos[:length], self._rope_sin[:length]
        slot_index = None if slots is None else torch.tensor(slots, device=self.device)
        positions = torch.arange(length, device=self.device) if self.fused_kernels else None

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)
            if positions is not None:
                kv = None if cache is None else (cache.keys[layer], cache.values[layer])
                self._rotary(qkv, positions, kv, slot_index)
                q, k, v = self._heads(qkv, batch, length)
            else:
                q, k, v = self._heads(qkv, batch, length)
                q, k = fused.torch_rotate(q, cos, sin), fused.torch_rotate(k, cos, sin)
                if cache is not None and slot_index is not None:
                    cache.keys[layer][slot_index, :, :length] = k
                    cache.values[layer][slot_index, :, :length] = v
            attn = self._prefill_attention(q, k, v, None)
            return attn.transpose(1, 2).reshape(batch, length, -1)

        return self._layers(self.embed[input_ids], attend)

    def _forward_extend(
        self, input_ids: Tensor, lengths: list[int], cache: KVCache, slots: list[int], starts: list[int]
    ) -> Tensor:
        """input_ids [B, T] at positions `starts[b]..` of `slots[b]`, whose earlier KV is in `cache`."""
        batch, length = input_ids.shape
        device = self.device
        offsets = torch.arange(length, device=device)
        start_t = torch.tensor(starts, device=device).unsqueeze(1)
        positions = start_t + offsets  # [B, T]
        valid = offsets < torch.tensor(lengths, device=device).unsqueeze(1)
        # Padding writes its K/V at the last cache position, which the capacity rule keeps free.
        write_positions = torch.where(valid, positions, cache.capacity - 1)
        attend_length = max(start + n for start, n in zip(starts, lengths, strict=True))
        self.ensure_rope(attend_length)
        fused_path = self.fused_kernels
        # [B, 1, T, D] each, for the torch path.
        rope = (
            None
            if fused_path
            else (self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1))
        )
        slot_index = torch.tensor(slots, device=device)
        slot_column = slot_index.unsqueeze(1)
        # [B, 1, T, L]: query at position p sees keys 0..p of its own slot.
        mask = torch.arange(attend_length, device=device).view(1, 1, 1, attend_length) <= positions.view(
            batch, 1, length, 1
        )

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)
            layer_keys, layer_values = cache.keys[layer], cache.values[layer]
            if fused_path:
                self._rotary(qkv, positions, (layer_keys, layer_values), slot_index, write_positions)
                q = self._heads(qkv, batch, length)[0]
            else:
                assert rope is not None
                q, k, v = self._heads(qkv, batch, length)
                q, k = fused.torch_rotate(q, *rope), fused.torch_rotate(k, *rope)
                # Advanced indices around a slice put their dims first: the target is [B, T, kv_heads, D].
                layer_keys[slot_column, :, write_positions] = k.transpose(1, 2)
                layer_values[slot_column, :, write_positions] = v.transpose(1, 2)
            keys = layer_keys[slot_index, :, :attend_length]
            values = layer_values[slot_index, :, :attend_length]
            attn = self._prefill_attention(q, keys, values, mask)
            return attn.transpose(1, 2).reshape(batch, length, -1)

        return self._layers(self.embed[input_ids], attend)

    @torch.inference_mode()
    def decode(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache,
        attend_length: int,
        lengths: Tensor | None = None,
    ) -> Tensor:
        """One decode step for slots 0..B-1: input_ids [B] at positions [B] -> hidden states [B, hidden].

        Writes the new K/V at `positions`; row b attends to its first `lengths[b]` positions (default
        `positions + 1`). With the decode kernel (`decode_kernel`, CUDA with Triton) each row reads only its
        own length; otherwise SDPA attends over the first `attend_length` positions of each slot (at least
        max(lengths)), masking positions beyond each row's own. Shapes depend only on B and `attend_length`,
        so a captured CUDA graph replays this unchanged.
        """
        c = self.config
        batch = input_ids.shape[0]
        group = c.num_heads // c.num_kv_heads
        fused_path = self.fused_kernels
        # [B, 1, D] each, for the torch path.
        rope = (
            None
            if fused_path
            else (self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1))
        )
        rows = torch.arange(batch, device=input_ids.device)
        if lengths is None:
            lengths = positions + 1
        mask = None
        if not self.decode_kernel:
            # [B, 1, 1, L]: a row may attend to its first lengths[b] positions.
            mask = (torch.arange(attend_length, device=input_ids.device) < lengths.unsqueeze(1)).view(
                batch, 1, 1, attend_length
            )
        row_lengths = lengths

        def attend(layer: int, h: Tensor) -> Tensor:
            qkv = self._project_qkv(layer, h)
            layer_keys, layer_values = cache.keys[layer], cache.values[layer]
            if fused_path:
                # Row b writes its K/V into slot b at positions[b].
                self._rotary(qkv, positions, (layer_keys, layer_values))
                q = self._split_qkv(qkv)[0]
            else:
                assert rope is not None
                q, k, v = self._split_qkv(qkv)
                q = fused.torch_rotate(q.view(batch, c.num_heads, c.head_dim), *rope)
                k = fused.torch_rotate(k.view(batch, c.num_kv_heads, c.head_dim), *rope)
                layer_keys[rows, :, positions] = k
                layer_values[rows, :, positions] = v.view(batch, c.num_kv_heads, c.head_dim)
            # Grouped-query attention without repeating K/V: the `group` query heads that share a KV head
            # become the query-length axis of one attention over that head.
            q = q.reshape(batch, c.num_kv_heads, group, c.head_dim)
            if mask is None:
                attn = decode_attention.decode_attention(q, layer_keys, layer_values, row_lengths)
            else:
                attn = F.scaled_dot_product_attention(
                    q,
                    layer_keys[:batch, :, :attend_length],
                    layer_values[:batch, :, :attend_length],
                    attn_mask=mask,
                )
            return attn.reshape(batch, -1)

        return self._layers(self.embed[input_ids], attend)
