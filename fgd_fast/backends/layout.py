"""Where the middle's ``p × p`` blocks lie: one batch of equal ``p``, or several batches of
different ``p`` in one flat buffer (so one middle serves every layer of a step).

A :class:`Layout` is a list of groups ``(L_k, p_k)``. A block of the step (A, E, M_Φ, …) is a
tensor in the layout's shape: ``(L, p, p)`` for one group, a flat ``(Σ L_k p_k²,)`` for
several (group k's layers ``(L_k, p_k, p_k)`` one after the other). Elementwise arithmetic then
runs once over every layer whatever its p, and only the products (and what needs a layer's
structure: transposes, per-layer sums and norms, the trace, per-layer values broadcast to the
layer's entries) go through the layout: per group for the products, by cached index tensors
for the rest. On a GPU that is one launch per elementwise op instead of one per group; on a
CPU one call's host time.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .shared_state import cache_lock, cached_entry

__all__ = ["Layout", "PER_GROUP_DEVICES", "rows"]


def rows(x: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """``x[first:end]`` along dim 0, as ``x`` itself where that is all of it (else one narrow: a
    tensor's ``[a:b]`` costs several times the host time)."""
    return x if first == 0 and end == x.shape[0] else x.narrow(0, first, end - first)


class _Index:
    """Index tensors of a multi-group layout on one device (built once, cached). The two of one
    entry per block element (``perm``: transposes, ``layer``: per-layer values broadcast) are
    built on first use only: the fused Triton middle never reads them, and they would hold
    8 bytes per block element (int32) for the layout's lifetime."""

    def __init__(self, groups: tuple[tuple[int, int], ...], device: torch.device):
        self.groups, self.device = groups, device
        self.diag = self._cat([torch.arange(p) * (p + 1) + at for p, at in self._blocks()])  # the diagonals
        sizes = [p for n, p in groups for _ in range(n)]
        self.lengths = torch.tensor([p * p for p in sizes], dtype=torch.long, device=device)  # entries per layer
        self.diag_lengths = torch.tensor(sizes, dtype=torch.long, device=device)
        self.eyes: dict[torch.dtype, torch.Tensor] = {}
        self.p: torch.Tensor | None = None
        self.memo: OrderedDict = OrderedDict()  # (Layout.cached: at most _MEMO_CAPACITY unpinned entries)
        self.memo_pinned: set = set()
        self._perm: torch.Tensor | None = None
        self._layer: torch.Tensor | None = None

    def _blocks(self):
        """Each layer's ``(p, offset of its block)``, in layout order."""
        at = 0
        for count, p in self.groups:
            for _ in range(count):
                yield p, at
                at += p * p

    def _cat(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        # int32: index_select takes it, and no layout has 2³¹ block entries (8 GiB of one float32 block)
        out = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        return out.to(device=self.device, dtype=torch.int32)

    @property
    def perm(self) -> torch.Tensor:
        """Entry (i, j) of every layer's block reads (j, i): the transpose as one index_select."""
        if self._perm is None:
            transposed = lambda p: (torch.arange(p)[None, :] * p + torch.arange(p)[:, None]).reshape(-1)  # noqa: E731
            with torch.inference_mode(False):  # (kept across steps, and shared by every backend)
                self._perm = self._cat([transposed(p) + at for p, at in self._blocks()])
        return self._perm

    @property
    def layer(self) -> torch.Tensor:
        """Each block entry's layer (a per-layer value broadcast by one index_select)."""
        if self._layer is None:
            with torch.inference_mode(False):
                sizes = torch.tensor([p * p for n, p in self.groups for _ in range(n)])  # (on the host)
                self._layer = self._cat([torch.repeat_interleave(torch.arange(len(sizes)), sizes)])
        return self._layer


#: Device types whose per-layer sums and norms run per group (one reduction per group), not as one
#: segmented reduction over the flat buffer (one launch on a GPU; 4–10× slower on a CPU,
#: ``studies/cpu_host_ops``). Both give the same values; the tests run the segmented one here too.
PER_GROUP_DEVICES = ("cpu",)

_PIECES_KEPT = 16  # blocks whose per-group views a layout keeps (pieces)
_indices: dict[tuple, _Index] = {}
_INDEX_CAPACITY = 32  # unpinned entries kept, the oldest evicted first
#: a layout's memo entries kept (least recently used evicted first): some are keyed on values such
#: as the guard's limit, which a search over them changes from run to run
_MEMO_CAPACITY = 64
_pinned: set = set()  # entries used while a CUDA graph was captured: its replays read them, never evicted


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA; a capture needs
    CUDA initialised: the cheap test first, ``is_available()`` costs host time)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class Layout:
    """Groups ``(L_k, p_k)`` of layers whose ``p × p`` blocks one middle computes."""

    def __init__(self, groups, device: torch.device | str = "cpu"):
        self.groups = tuple((int(n), int(p)) for n, p in groups)
        self.device = torch.device(device)
        self.count = sum(n for n, _ in self.groups)
        self.single = len(self.groups) == 1
        self.numel = sum(n * p * p for n, p in self.groups)
        # how the middle's products run over this layout: None, torch (one batched product per
        # group); or a function of the backend's (the Triton backend's: one launch for every p)
        self.products = None
        self._pieces: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # (block, its views), newest first
        self.spans, at, first = [], 0, 0
        for n, p in self.groups:  # (flat start, first layer, layers, p) per group
            self.spans.append((at, first, n, p))
            at += n * p * p
            first += n

    @classmethod
    def of(cls, x: torch.Tensor) -> Layout:
        """The one-group layout of a ``(L, p, p)`` batch."""
        return cls([(x.shape[0], x.shape[-1])], x.device)

    # -- memory ---------------------------------------------------------------------------
    def empty(self, dtype: torch.dtype) -> torch.Tensor:
        """A new block in the layout's shape."""
        n, p = self.groups[0]
        shape = (n, p, p) if self.single else (self.numel,)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pieces(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each group's ``(L_k, p_k, p_k)`` view of block ``x`` (the last few blocks' views are
        kept: a block enters several products, and each view costs host time)."""
        if self.single:
            return [x]
        for held, views in self._pieces:
            if held is x:
                return views
        if x.is_contiguous() and not torch.compiler.is_compiling():  # one op per group, not a slice and a view
            base = x.storage_offset()
            views = [x.as_strided((n, p, p), (p * p, p, 1), base + at) for at, _, n, p in self.spans]
        else:
            views = [x[at : at + n * p * p].view(n, p, p) for at, _, n, p in self.spans]
        self._pieces = [(x, views)] + self._pieces[: _PIECES_KEPT - 1]
        return views

    def layers(self, x: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Layers ``first:end`` (within one group) of block ``x``, ``(end − first, p, p)``."""
        if self.single:
            return rows(x, first, end)
        for k, (_, start, n, _) in enumerate(self.spans):
            if start <= first and end <= start + n:
                piece = self.pieces(x)[k]  # (views kept: the group's blocks are handed out whole, mostly)
                return rows(piece, first - start, end - start)
        raise ValueError(f"layers {first}:{end} span groups of {self.groups}")

    def memo(self, key: tuple, p: torch.Tensor):
        """``key[0](key[1], p, *key[2:])`` with p per layer (e.g. the guard's target), computed
        once per layout and key."""
        return self.cached(key, lambda: key[0](key[1], p, *key[2:]))

    def cached(self, key: tuple, build):
        """``build()``, made once per layout, device and key (e.g. a kernel's work table): kept
        with the layout's indices (and, like them, pinned while a CUDA graph is captured)."""
        index = self._index()  # (a captured graph's replays read the entry's memory: pinned then)
        return cached_entry(index.memo, index.memo_pinned, key, build, _MEMO_CAPACITY, _capturing())[0]

    def tiles(self, tile: int, key: tuple, row) -> tuple[torch.Tensor, torch.Tensor]:
        """The work table of a kernel over every layer's ``p × p`` block in ``tile × tile`` items:
        ``(layer, i, j)`` (int32, ``(items, 3)``), and a per-layer int64 table of rows
        ``row(layer, offset, p, first item, items)`` (``offset``: of the layer's block in the
        layout). Built once per layout, tile and ``key`` (which names ``row``)."""

        def build():
            work, rows, at = [], [], 0
            for k, p in enumerate(p for n, p in self.groups for _ in range(n)):
                t = -(-p // tile)
                rows.append(row(k, at, p, len(work), t * t))
                work += [(k, i, j) for i in range(t) for j in range(t)]
                at += p * p
            as_tensor = lambda rows, dtype: torch.tensor(rows, dtype=dtype).to(self.device)  # noqa: E731
            return as_tensor(work, torch.int32).reshape(-1, 3), as_tensor(rows, torch.int64)

        return self.cached(("tiles", tile, *key), build)

    def per_layer(self, v) -> torch.Tensor:
        """A float, or ``L`` per-layer values in any shape, as ``(L,)`` float64 (a float's vector
        built once per layout: kernels take per-layer tables)."""
        if isinstance(v, torch.Tensor):
            return (
                v.reshape(-1).to(torch.float64) if v.numel() == self.count else v.to(torch.float64).expand(self.count)
            )
        value = float(v)
        return self.cached(
            ("per-layer", value), lambda: torch.full((self.count,), value, dtype=torch.float64, device=self.device)
        )

    def p_per_layer(self) -> torch.Tensor:
        """``(L,)`` float64: each layer's p."""
        index = self._index()
        if index.p is None:  # (two threads may both build it: the same values, one kept)
            with torch.inference_mode(False):
                p = torch.tensor([float(p) for n, p in self.groups for _ in range(n)], dtype=torch.float64)
                index.p = p.to(self.device)
        return index.p

    def _index(self) -> _Index:
        key = (self.groups, str(self.device))  # (a string: torch.compile guards on the dict by its keys)
        with cache_lock():  # (another thread's step may look up or insert at once; the index built outside)
            index = _indices.get(key)
        if index is None:
            with torch.inference_mode(False):  # (kept across steps, and shared by every backend)
                made = _Index(self.groups, self.device)
            with cache_lock():
                index = _indices.get(key)
                if index is None:
                    unpinned = [k for k in _indices if k not in _pinned]
                    if len(unpinned) >= _INDEX_CAPACITY:
                        del _indices[unpinned[0]]
                    index = _indices[key] = made
        if _capturing():
            with cache_lock():
                _pinned.add(key)
        return index

    # -- structure ------------------------------------------------------------------------
    def t(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer's block transposed (a view for one group)."""
        return x.transpose(-1, -2) if self.single else x.index_select(0, self._index().perm)

    def sym(self, x: torch.Tensor) -> torch.Tensor:
        """``sym(X) = (X + Xᵀ)/2`` per layer."""
        return (x + self.t(x)).mul_(0.5)

    def col(self, v):
        """A per-layer value (float, or ``L`` values in any shape) broadcast to the blocks' entries."""
        if not isinstance(v, torch.Tensor):
            return v
        v = v.reshape(-1)
        return v.view(-1, 1, 1) if self.single else v.index_select(0, self._index().layer)

    def sums(self, x: torch.Tensor) -> torch.Tensor:
        """``(L,)`` the sum of each layer's entries."""
        if self.single:
            return x.sum((-2, -1))
        if self.device.type in PER_GROUP_DEVICES:  # per group (see PER_GROUP_DEVICES)
            return torch.cat([piece.sum((-2, -1)) for piece in self.pieces(x)])
        # (unsafe: the lengths are right by construction, and their check would read the device on the host)
        return torch.segment_reduce(x, "sum", lengths=self._index().lengths, unsafe=True)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """``(L,)`` each layer's Frobenius norm."""
        if self.single:
            return torch.linalg.matrix_norm(x)
        if self.device.type in PER_GROUP_DEVICES:  # per group, as sums
            return torch.cat([torch.linalg.matrix_norm(piece) for piece in self.pieces(x)])
        return self.sums(x * x).sqrt()

    def norms(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """``(k, L)`` each layer's Frobenius norm in each of ``k`` blocks, by one multi-tensor op
        over every layer's view (two ops in all, whatever the number of groups and blocks). (On a
        CPU a matrix norm per group over the stacked blocks takes about half the time, ~0.1 ms a
        step, but ``groups + 2`` ops: it would take the torch backend past its op ceiling,
        ``tests/test_op_count.py``; ``studies/cpu_host_ops`` measures both.)"""
        layers = [layer for x in blocks for piece in self.pieces(x) for layer in piece.unbind(0)]
        return torch.stack(torch._foreach_norm(layers)).view(len(blocks), self.count)

    def trace(self, x: torch.Tensor) -> torch.Tensor:
        """``(L,)`` each layer's trace."""
        if self.single:
            return x.diagonal(dim1=-2, dim2=-1).sum(-1)
        index = self._index()
        return torch.segment_reduce(x.index_select(0, index.diag), "sum", lengths=index.diag_lengths, unsafe=True)

    def eye(self, dtype: torch.dtype) -> torch.Tensor:
        """The identity of every layer (broadcasts against a block)."""
        if self.single:
            return torch.eye(self.groups[0][1], dtype=dtype, device=self.device)
        index = self._index()
        if dtype not in index.eyes:
            with torch.inference_mode(False):
                eye = torch.zeros(self.numel, dtype=dtype, device=self.device)
                eye[index.diag] = 1.0
            index.eyes[dtype] = eye
        return index.eyes[dtype]

    def inner(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """``(L, k, k)`` float64 inner products ``⟨Xᵢ, Xⱼ⟩`` of each layer's ``k`` blocks."""
        if self.single:
            stacked = torch.stack(blocks, 1).flatten(2).to(torch.float64)  # (L, k, p²)
            return stacked @ stacked.mT
        k = len(blocks)
        stacked = torch.stack(blocks).to(torch.float64)  # (k, F)
        per_group = []
        for at, _, n, p in self.spans:  # (n, k, p²) @ (n, p², k) per group
            piece = stacked[:, at : at + n * p * p].view(k, n, p * p).transpose(0, 1)
            per_group.append(piece @ piece.mT)
        return torch.cat(per_group)
