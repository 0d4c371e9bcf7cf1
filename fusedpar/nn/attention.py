"""Context-parallel attention: a drop-in for the SDPA call of a Llama-style attention whose
sequence is split across the ranks of a ``cp`` group (``fusedpar.ops.ring_attention``).

Hugging Face: :func:`set_hf_context_parallel_group` registers
:func:`hf_context_parallel_attention` in ``transformers.AttentionInterface`` as
``"fusedpar_cp"`` (``import fusedpar`` does too when transformers is already imported);
then set ``config._attn_implementation = "fusedpar_cp"``. Feed the model this rank's part of the
sequence (``fusedpar.parallel.zigzag_shard``) with its global ``position_ids``
(``zigzag_positions``) so RoPE sees global positions.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from ..comm import resolve_group
from ..ops.all_gather import all_gather
from ..ops.flash_attention import from_host_list
from ..ops.ring_attention import DISPATCHER, ring_attention
from ..ops.ring_attention.call import LAYOUTS, layout_positions, packed_layout


def choose_backend(heads: int, kv_heads: int, world: int, packed: bool = False) -> str | None:
    """The ring_attention backend for these head counts (identical on every rank):
    with fewer K/V heads than ranks, moving K/V is cheap and a ring gains little: Ulysses
    (all-to-all of heads) when the heads split over the ranks and the sequence is not
    ``packed`` documents (Ulysses runs none), else all-gather K/V;
    otherwise None: a ring, whose K/V exchange hides behind the blocks (ring_attention's
    own choice: ``triton`` where symmetric memory works, else ``pipelined``)."""
    if kv_heads < world:
        ulysses = heads % world == 0 and world % kv_heads == 0 and not packed
        return "ulysses" if ulysses else "allgather_kv"
    return None


class ContextParallelAttention(nn.Module):
    """``F.scaled_dot_product_attention`` over a sequence split across ``group``; the same as::

        full = [unshard(t, dim=2) for t in (query, key, value)]   # [B, H, S, D] each
        out = F.scaled_dot_product_attention(*full, is_causal=is_causal, scale=scale,
                                             enable_gqa=True)
        return shard(out, dim=2)                                   # this rank's rows

    ``query [B, H, S_local, D]``, ``key``/``value [B, H_kv, S_local, D]`` (after RoPE), this
    rank's part of the sequence in ``layout`` (``"zigzag"``, the default, balances causal
    work; ``"contiguous"``; ``"zigzag_docs"``: packed documents, each zigzag, which needs
    ``cu_seqlens``, see ``fusedpar.parallel.sequence_shard``). ``cu_seqlens``: packed
    documents over the global sequence (B = 1), each attending only to itself. ``backend``:
    a ``ring_attention`` backend, or None to choose from the head counts
    (:func:`choose_backend`). ``window_size`` / ``softcap``: a sliding window or
    soft-capping as ``fusedpar.ops.flash_attention``'s (SDPA has neither; the equivalent
    then masks and caps the scores by global position). Differentiable; no parameters.
    """

    def __init__(self, group=None, backend: str | None = None, layout: str = "zigzag"):
        super().__init__()
        if backend is not None and backend not in DISPATCHER.names:
            raise ValueError(f"ContextParallelAttention: backend={backend!r}; choose one of "
                             f"{DISPATCHER.names} or None (chosen from the head counts)")
        if layout not in LAYOUTS:
            raise ValueError(f"ContextParallelAttention: layout={layout!r}; choose one of {LAYOUTS}")
        self.group, self.backend, self.layout = group, backend, layout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                is_causal: bool = True, scale: float | None = None,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        out = self.attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          is_causal, scale, window_size, softcap, cu_seqlens)
        return out.transpose(1, 2)

    def attend(self, q, k, v, causal: bool, scale: float | None,
               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
               cu_seqlens: torch.Tensor | None = None, layout: str | None = None) -> torch.Tensor:
        """The same on ``[B, S_local, H, D]`` tensors (flash-attn's layout); ``window_size``
        and ``softcap`` as ``flash_attention``'s, by global position. ``cu_seqlens``: packed
        documents over the global sequence (``ring_attention``'s: B = 1), each attending
        only to itself. ``layout``: this call's, if not the module's."""
        group = resolve_group(self.group)
        backend = self.backend or choose_backend(q.shape[2], k.shape[2], dist.get_world_size(group),
                                                 packed=cu_seqlens is not None)
        # None: ring_attention picks the ring backend (the same on every rank)
        return ring_attention(q, k, v, group, causal=causal, softmax_scale=scale,
                              window_size=window_size, softcap=softcap, layout=layout or self.layout,
                              cu_seqlens=cu_seqlens, backend=backend)

    def attend_padded(self, q, k, v, padding: torch.Tensor, causal: bool, scale: float | None,
                      window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> torch.Tensor:
        """``attend`` with a key-padding mask ``padding [B, S_local]`` (True: a token, False:
        padding; this rank's part in ``layout``), for left- or right-padded rows: the same as
        ``attend`` on the full sequence where every token attends only to tokens. A padded
        row runs as packed documents ``[its tokens]`` plus the padding before and after them
        (``allgather_kv``, the backend of packed documents), so tokens never see padding;
        padding positions attend among themselves (their outputs mean nothing, as in HF).
        Rows without padding run as ``attend``. Rows with padding between tokens raise, as
        does layout ``"zigzag_docs"`` (a padded row is not packed documents)."""
        if self.layout == "zigzag_docs":
            raise ValueError("fusedpar_cp attention: a padding mask with layout 'zigzag_docs' (packed "
                             "documents, each zigzag); pack the sequences without padding and pass "
                             "their cu_seqlens, or use layout='zigzag' for padded rows")
        group = resolve_group(self.group)
        gather = None if q.is_cuda else "reference"
        world = dist.get_world_size(group)
        full = all_gather(padding.to(torch.int32), 1, group, backend=gather)  # rank order
        # to global order (the same on every rank)
        full = full.index_select(1, layout_positions(self.layout, world, q.shape[1], device=full.device).argsort())
        seq, rows = full.shape[1], full.bool().tolist()
        mask = dict(window_size=window_size, softcap=softcap)
        if all(all(tokens) for tokens in rows):
            return self.attend(q, k, v, causal, scale, **mask)
        outs = []
        for row, tokens in enumerate(rows):
            one = (q[row:row + 1], k[row:row + 1], v[row:row + 1])
            if all(tokens):
                outs.append(self.attend(*one, causal, scale, **mask))
                continue
            where = [i for i, t in enumerate(tokens) if t]
            first, end = (where[0], where[-1] + 1) if where else (0, 0)
            if end - first != len(where):
                raise ValueError(
                    f"fusedpar_cp attention: row {row} of the attention mask has padding between "
                    f"tokens (tokens at global positions {first}..{end - 1}, {len(where)} of them); "
                    "only left or right padding is supported: pack such sequences instead")
            ends = sorted({0, first, end, seq})
            cu = from_host_list(ends, q.device)  # ring_attention reads it: no read back
            outs.append(ring_attention(*one, group, causal=causal, softmax_scale=scale, **mask,
                                       layout=self.layout, cu_seqlens=cu, backend="allgather_kv"))
        return torch.cat(outs, 0)

    def extra_repr(self) -> str:
        return f"backend={self.backend or 'auto'}, layout={self.layout}"


_HF = {"module": None}


def set_hf_context_parallel_group(group=None, backend: str | None = None, layout: str = "zigzag"):
    """Register ``"fusedpar_cp"`` with transformers and set the group (and backend, layout)
    it uses."""
    if not register_with_transformers():
        raise ImportError("set_hf_context_parallel_group needs transformers with "
                          "AttentionInterface (pip install 'transformers>=4.48')")
    _HF["module"] = ContextParallelAttention(group, backend, layout)


def hf_context_parallel_attention(module, query, key, value, attention_mask, scaling=None,
                                  dropout: float = 0.0, **kwargs):
    """``transformers`` attention function (``AttentionInterface`` signature): query
    ``[B, H, S_local, D]`` in, ``(out [B, S_local, H, D], None)`` out. Causal unless the
    layer says ``is_causal=False``. A layer's ``sliding_window`` (HF's: each token sees the
    ``sliding_window`` keys up to itself; flash-attn's ``window_size=(sliding_window - 1,
    sliding_window - 1)``, as transformers passes it to flash-attn) and ``softcap`` (Gemma 2's
    attention-logit soft-capping) are applied. ``attention_mask``: None, or this rank's 2-D padding mask
    (``[B, S_local]``, what the ``"fusedpar_cp"`` mask function passes on when the model got
    a padded ``attention_mask``, sharded like the input ids): left or right padding runs
    with ``ContextParallelAttention.attend_padded``; or a 1-D int32 ``cu_seqlens`` of packed
    documents over the global sequence (B = 1; what the parallelized forward passes for a
    packed row), each document attending only to itself; with the module's layout
    ``"zigzag"``, the row is taken as sharded by ``packed_layout`` (each document zigzag when
    every document is a multiple of ``2W`` long, else the whole row), as the parallelized
    forward shards it. A 4-D mask is refused: it cannot
    be applied to a sequence split across ranks."""
    cp = _HF["module"]
    if cp is None:
        raise RuntimeError("fusedpar_cp attention: call fusedpar.nn.attention."
                           "set_hf_context_parallel_group(group) before running the model")
    if dropout and module.training:
        raise ValueError(f"fusedpar_cp attention: attention dropout {dropout} is not supported; "
                         "set config.attention_dropout = 0")
    documents = attention_mask is not None and attention_mask.dim() == 1
    if attention_mask is not None and attention_mask.dim() != 2 and not documents:
        raise ValueError(f"fusedpar_cp attention: got a {attention_mask.dim()}-D attention mask of "
                         f"shape {tuple(attention_mask.shape)}; only a 2-D padding mask [B, S_local] "
                         "(this rank's part) or 1-D cu_seqlens of packed documents can be applied to "
                         "a sequence split across ranks (causality is applied by the kernel)")
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    causal = bool(causal if causal is not None else True)
    window = kwargs.get("sliding_window")
    mask = dict(window_size=(-1, -1) if window is None else (window - 1, window - 1),
                softcap=float(kwargs.get("softcap") or 0.0))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attention_mask is None:
        return cp.attend(q, k, v, causal, scaling, **mask), None
    if documents:
        layout = None
        if cp.layout == "zigzag":
            layout = packed_layout(attention_mask, dist.get_world_size(resolve_group(cp.group)))
        return cp.attend(q, k, v, causal, scaling, **mask, cu_seqlens=attention_mask, layout=layout), None
    return cp.attend_padded(q, k, v, attention_mask, causal, scaling, **mask), None


def padding_mask_only(*args, attention_mask=None, **kwargs):
    """The ``"fusedpar_cp"`` mask function: builds no mask (the attention applies causality
    itself) but passes a 2-D padding mask on. Whether it pads anything is decided in the
    attention, on the gathered mask: a rank's own part cannot tell (every rank must take
    the same path)."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return attention_mask
    return None


def register_with_transformers() -> bool:
    """Register ``"fusedpar_cp"`` (attention, and a mask function that builds no mask);
    False if transformers (with AttentionInterface) is not installed."""
    try:
        import transformers
    except ImportError:
        return False
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is None:
        return False
    interface.register("fusedpar_cp", hf_context_parallel_attention)
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is not None:
        masks.register("fusedpar_cp", padding_mask_only)
    return True


if "transformers" in sys.modules:  # never import it just for this (slow)
    register_with_transformers()
