"""The small backend interface the DeepSeek-V4 model is written against.

Shapes use ``n`` = new tokens of one sequence, ``T`` = tokens of the whole batch, ``H`` heads,
``d`` head dim, ``K`` candidate keys. Every op takes and returns torch tensors; none keeps state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Ops(Protocol):
    name: str
    batch_invariant: bool  # results of a row never depend on the other rows of the call (docs/determinism.md)
    native_weights: bool  # keep FP8 / MXFP4 weights as stored (quant.native) and run fp8_linear / moe_mxfp4

    def pointwise(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``fn(x)`` for an element-wise torch function (exp, sigmoid, silu, softplus, cos, sin, …).
        Batch-invariant backends make every element take the same code path (torch's CPU kernels
        compute the SIMD body and the tail of a tensor differently, so a value would otherwise depend
        on where its row sits in the batch)."""
        ...

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` (``F.linear`` without bias): ``x [..., K]``, ``w [N, K]`` → ``[..., N]`` in ``x.dtype``."""
        ...

    def logits_linear(self, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The output head: ``y @ w.T`` computed and returned in fp32 (``y [T, K]`` and ``w [V, K]`` in any float
        dtype; bf16 operands are exact in fp32, so a bf16 GEMM with fp32 accumulation and output is the same sum)."""
        ...

    def grouped_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-group products ``x [n, g, K]``, ``w [g, R, K]`` → ``[n, g, R]``."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """``w · x / rms(x)`` over the last dim, computed in fp32, returned in ``x.dtype``."""
        ...

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, inplace: bool = False
    ) -> torch.Tensor:
        """Interleaved (GPT-J pair) rotation of the last ``2·cos.shape[-1]`` dims of ``x``. ``inplace``: the caller
        no longer needs ``x``, so the result may be written into it (a backend then moves only the rotated dims);
        the result is the returned tensor either way."""
        ...

    def hc_mixes(
        self,
        h: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC weights of streams ``h [T, N, D]``: ``pre [T, N]``, ``post [T, N]``, Sinkhorn ``comb [T, N, N]``."""
        ...

    def hc_pre(
        self,
        h: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        iters: int,
        eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hc_mixes`` then ``hc_collapse`` with its ``pre``: ``(x [T, D], post [T, N], comb [T, N, N])``."""
        ...

    def hc_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``Σ_j pre[:, j] · h[:, j]``: streams ``h [T, N, D]`` → ``[T, D]`` (fp32 sum, ``h.dtype`` out)."""
        ...

    def hc_expand(self, y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``post[:, k] · y + Σ_j comb[:, j, k] · res[:, j]`` → streams ``[T, N, D]`` in ``y.dtype``."""
        ...

    def softmax_pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Compressor pooling: ``Σ_m softmax_m(score) · kv`` over dim 1 of ``[k, m, d]`` → ``[k, d]`` fp32."""
        ...

    def group_pool(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        cur: torch.Tensor,
        prev: torch.Tensor | None,
        has_prev: torch.Tensor,
        live: torch.Tensor,
        d: int,
    ) -> torch.Tensor:
        """A compressor's groups pooled from its pending rows by index (``kernels.group_pool``): ``kv``, ``score``
        ``[N, C]`` fp32; row ``s`` pools rows ``cur[s]`` ``[S, m]`` and, overlapping (``prev`` given, ``C = 2d``),
        first the first ``d`` channels of rows ``prev[s]`` where ``has_prev[s]`` (else value 0, score ``-inf``), then
        the last ``d`` of ``cur[s]``; ``softmax_pool`` of that → ``[S, d]`` fp32, zeros where ``live`` is False."""
        ...

    def linear_fp32(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x · wᵀ`` computed in fp32 whatever the dtypes (the official fp32 GEMMs of the compressors and the
        router): exact products of the values, fp32 sums → fp32."""
        ...

    def sparse_attention(
        self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention with K = V and a per-head sink logit: ``q [n, H, d]``, ``keys [K, d]``, ``mask [n, K]``."""
        ...

    def sparse_attention_lists(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        idx: torch.Tensor,
        count: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sparse_attention`` with a key list per query: query ``t`` attends to ``keys[idx[t, :count[t]]]``
        (``idx [T, W]``; entries past ``count`` are never read). Several sequences share one call. ``paged = (store
        [P, R, d], pages [M])``: the keys continue past ``keys`` with the rows of the listed pages of a paged store,
        key ``len(keys) + j`` being row ``j % R`` of page ``pages[j // R]`` (``kernels.paged_keys.gathered``); a
        backend may read them in place. ``out`` (contiguous, ``q``'s shape and dtype): the result is written there and
        returned (a CUDA graph reads it from a fixed address)."""
        ...

    def indexer_scores_ranges(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        weights: torch.Tensor,
        start: torch.Tensor,
        width: int,
        paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``indexer_scores`` with a key range per query: ``[T, width]``, column ``r`` of row ``t`` scoring
        ``keys[start[t] + r]`` (columns past the end of ``keys`` are 0; the caller masks what a query may not see).
        ``paged``: as ``sparse_attention_lists``' (the keys continue with the listed pages' rows; a backend may read
        them in place)."""
        ...

    def indexer_scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Lightning-indexer scores ``Σ_h weights[:, h] · relu(q[:, h] · keys)`` → ``[n, R]``."""
        ...

    def topk_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Top-``k`` column indices per row; ties go to the lower index (documented tie rule)."""
        ...

    def select_rows(self, scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The visible rows among each row's ``topk_indices(scores, k)``, in ascending order: ``scores [..., W]`` (any
        float dtype) and bool ``visible`` of the same shape → ``(rows [..., min(k, W)] long, count [...] long)``, where
        ``rows[..., :count]`` are the chosen visible rows ascending and ``count`` how many there are. Entries at and
        past ``count`` are never read by the callers; they are row indices in ``[0, W)``, but which ones is up to the
        backend (the reference lists the rows it did not choose, ascending)."""
        ...

    def moe(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        limit: float,
        act_quant: bool = False,
    ) -> torch.Tensor:
        """Routed SwiGLU experts (``w1/w3 [E, I, D]``, ``w2 [E, D, I]``): ``Σ_k weights[:, k] · expert(x)``.

        The routing weight multiplies the expert's hidden state before ``w2``; the sum is fp32. ``act_quant``: the
        official FP8 activations, ``x`` and each slot's hidden row (rounded to ``x.dtype``) rounded as
        ``act_quant_sim(·, 128)`` before their GEMMs, where the width is a multiple of 128."""
        ...

    def route(
        self, logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """V4's router after its fp32 GEMM: ``s = sqrt(softplus(logits))`` ``[T, E]``; the experts ``idx`` given (hash
        layers) or ``topk_indices(s + bias, k)``; weights ``s[idx] / Σ s[idx] · scaling`` → ``(idx [T, k] long,
        weights [T, k] fp32)``."""
        ...

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
        """``silu(min(gate, limit)) · clamp(up, ±limit)`` in fp32, rounded to ``dtype`` (the shared expert)."""
        ...

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, act_quant: bool) -> torch.Tensor:
        """``linear`` with an FP8 weight kept as stored: ``w [N, K]`` e4m3, ``scale [ceil(N/B0), ceil(K/B1)]`` float32
        powers of two (``W = w · scale`` per block, exact in bf16). ``act_quant``: the input is first rounded as
        ``act_quant_sim(x, 128)`` (the official FP8 activation). → ``[..., N]`` in ``x.dtype``."""
        ...

    def fp8_grouped_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``grouped_linear`` with an FP8 weight kept as stored: ``x [T, G, K]``, ``w [G·R, K]`` e4m3 and its block
        ``scale`` (as ``fp8_linear``), the dequantised weight viewed ``[G, R, K]`` → ``[T, G, R]`` in ``x.dtype``."""
        ...

    def moe_mxfp4(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        weights: torch.Tensor,
        w1: torch.Tensor,
        s1: torch.Tensor,
        w2: torch.Tensor,
        s2: torch.Tensor,
        w3: torch.Tensor,
        s3: torch.Tensor,
        limit: float,
        order: str = "plain",
        act_quant: bool = False,
        refs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``moe`` with MXFP4 experts kept packed: ``w1/w3 [E, I, D/2]``, ``w2 [E, D, I/2]`` int8 e2m1 pairs and
        uint8 e8m0 exponents ``s1/s3 [E, I, D/32]``, ``s2 [E, D, I/32]`` (``quant.native``); the semantics are
        ``moe`` on the weights decoded to ``x.dtype``. ``order``: the order of the codes, ``plain``, ``shift`` or
        ``rotate`` (``quant.nibble_order``). ``act_quant``: the official FP8 activations: ``x`` and each slot's
        hidden row (rounded to ``x.dtype``) rounded as ``act_quant_sim(·, 128)`` before their GEMMs, where the width
        is a multiple of 128. ``refs``: the weights' row references (``quant.w4a8.row_refs``) where a backend may run
        the products on FP8 tensor cores (W4A8, the same results up to the order and precision of the fp32 sums);
        ignored without ``act_quant`` and by backends without such kernels."""
        ...

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Rearrange the weights a model keeps in their stored formats for this op set's kernels, once, after they
        are loaded and placed (before any CUDA graph is captured). The reference op set leaves them as they are."""
        ...

    def act_quant_sim(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """FP8 e4m3 round-trip with per-``block`` UE8M0 scales along the last dim."""
        ...

    def fp4_quant_sim(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """MXFP4 (e2m1) round-trip with per-``block`` UE8M0 scales along the last dim."""
        ...

    def cache_round(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """DeepSeek-V4.1's cache round trip ``fmt`` over the last dim, in ``x.dtype``: ``fp8`` (window KV,
        ``quant.cache.fp8_window_round``), ``nvfp4`` (compressed rows, ``nvfp4_round``) or ``mxfp4`` (index keys and
        queries, ``mxfp4_round``)."""
        ...

    # DeepSeek-V4's decode-step glue (models/deepseek_v4/decode_step.py): index arithmetic and copies, exact
    def step_indices(
        self,
        meta: torch.Tensor,
        tables: torch.Tensor | None,
        window: int,
        win_width: int,
        ratios: tuple[tuple[int, int, int, bool, bool], ...],
        rings: tuple[tuple[int, int], ...],
        page_size: int,
        scratch_page: int,
    ) -> tuple[tuple, tuple, tuple]:
        """Every index tensor of a decode step (``decode_step.V4DecodePlan``) from ``meta [4, S]`` (slot, position,
        window start ``floor``, liveness; int64) and the block tables ``[S, P]`` (None without ``ratios`` and
        ``rings``):

        * the window ``(first, live, put, take, start, count, idx)``: the first window position ``max(floor, pos -
          window + 1, 0)``, ``live`` bool, the new row's ring row ``slot·window + pos % window``, the ring rows in
          position order ``take [S·window]``, each row's window rows in the gathered pool (``start``, ``count``) and
          its key list ``idx [S, win_width]`` (``start + j``);
        * per ratio ``(m, rows, pages, lists, visible)``: ``(count, r_start, i_start, visible, idx, cnt)``: the
          visible compressed rows ``(pos + 1) // m``, row 0 of each row's ``pages · page_size / m`` gathered rows
          after the ``S·window`` window rows (``r_start``; ``i_start`` without the window rows), the bool mask
          ``visible [S, rows]`` (``r < count``; None unless asked) and the all-rows key lists ``key_lists`` of rows
          ``r_start + r``, ``r < rows`` (None unless ``lists``);
        * per ring ``(m, cap)``: ``(at, cur, prev, has_prev, w, done, page, row)``: the new projections' ring row,
          the groups ``cur``, ``prev [S, m]`` (ring rows of positions ``w·m + j`` and ``(w - 1)·m + j``, never below
          ``floor``) of the last group ``w = max((pos + 1) // m - 1, 0)``, ``has_prev [S, 1, 1]`` (``w > 0``),
          ``done`` (live and completing a group), the page its row goes to (``tables[s, w // (page_size / m)]``,
          ``scratch_page`` unless ``done``) and the row in it.

        Int64 outputs, bool masks; a pure function of its inputs with shapes from the host ints (capturable)."""
        ...

    def key_lists(
        self,
        w_start: torch.Tensor,
        w_cnt: torch.Tensor,
        win_width: int,
        sel: torch.Tensor,
        r_start: torch.Tensor,
        r_cnt: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row its key list ``[S, win_width + C]``: its ``w_cnt`` window rows ``w_start + j``, then the compressed
        rows ``sel [S, C] + r_start`` (the first ``r_cnt`` valid); entry ``j ≥ w_cnt`` is ``sel[s, min(j - w_cnt, C -
        1)] + r_start[s]`` (0 when ``C = 0``); and the counts ``w_cnt + r_cnt``."""
        ...

    def append_rows(
        self,
        dsts: list[torch.Tensor],
        idxs: list[torch.Tensor],
        srcs: list[torch.Tensor],
        take: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``dst.index_copy_(0, idx, src.to(dst.dtype))`` for every ``(dst, idx, src)`` (a layer's ring appends), then,
        with ``take``, ``index_select(dsts[0], 0, take, out=out)`` (its window rows; ``take [S·k]`` holds ``k`` entries
        per row of ``idxs[0]``). Where two rows write one row (padding rows), any of them may win, and a ``take``
        entry naming another row's new row may read the old value; a row's own new row is always the new value."""
        ...

    def store_rows(
        self,
        store: torch.Tensor,
        page: torch.Tensor,
        row: torch.Tensor,
        rows: torch.Tensor,
        pages: torch.Tensor,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``store[page, row] = rows.to(store.dtype)`` (``store [N, R, D]``, ``page``, ``row``, ``rows`` per row
        ``s < S``), then ``index_select(store, 0, pages, out=into)`` (``pages [S·P]``: row ``s``'s pages ``s·P ..``):
        a compressor's new rows stored and every row's pages gathered. As in ``append_rows``, a gathered row that
        another row writes may read the old value; a row's own written row, in its own pages, is the new value."""
        ...

    def compress_score(
        self, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor, ratio: int
    ) -> torch.Tensor:
        """A compressor's scores: the fp32 gate ``[T, C]`` plus its position bias ``ape.float()[positions % ratio]``."""
        ...

    def parallel(
        self, first: Callable[[], object], second: Callable[[], object], device: torch.device
    ) -> tuple[object, object]:
        """``(first(), second())``, the two free to run at once on ``device`` (independent work: neither reads what
        the other writes); the results are those of running them one after the other."""
        ...

    def moe_combine(self, y: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The MoE's output: the routed experts' fp32 sum ``y`` plus the shared expert's ``shared.float()``, in
        ``dtype``."""
        ...
