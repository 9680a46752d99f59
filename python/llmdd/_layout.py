"""KV layouts and slice transfers (docs/python.md, "KV layouts"): caches
described by a layout name ("NHD", "HND", or an explicit dim order) with a
block size and a head range, slices of token positions and global heads,
and llmdd_tp_plan. Instance methods are attached in __init__."""

import collections
import ctypes

from . import _ffi
from ._ffi import lib
from ._status import check
from ._values import _int, _u32, _u64, _ext, _index, _bad_cache, _U32_MAX, as_int, as_ints

__all__ = ["KvLayout", "Slice", "TpPiece", "tp_plan", "slice_plan_size"]

_U64_MAX = 2**64 - 1
_DIMS = {"N": _ffi.KV_DIM_TOKEN, "H": _ffi.KV_DIM_HEAD, "P": _ffi.KV_DIM_PART,
         "D": _ffi.KV_DIM_BYTES}


def _order(order):
    """"NHD", "HND", "PNHD"... (BLOCK is implied first) or a list of
    llmdd_kv_dim values -> the C order and its names."""
    if isinstance(order, str):
        if not order or any(ch not in _DIMS for ch in order) or order[-1] != "D":
            raise ValueError(f"layout order {order!r}: letters N (tokens), H (heads), "
                             "P (parts) and D (a head's bytes, last), e.g. 'NHD'")
        return [_ffi.KV_DIM_BLOCK] + [_DIMS[ch] for ch in order], order
    dims = as_ints("order", order)
    return dims, None


class KvLayout:
    """One cache's KV layout: each tensor is [blocks] x one block whose dims
    are, outermost first, the order's ("NHD": tokens, heads, a head's bytes;
    "HND": heads, tokens, bytes; a P for K and V interleaved in a block).
    heads: the global head range (first, end) this cache holds; total_heads:
    the model's KV heads (MLA: 1); head_bytes: one head of one token."""

    __slots__ = ("order", "block_size", "head_first", "num_heads", "total_heads",
                 "head_bytes", "num_parts", "compat_tag")

    def __init__(self, order, block_size, heads, total_heads, head_bytes, num_parts=1,
                 compat_tag=0):
        dims, _ = _order(order)
        if not 4 <= len(dims) <= _ffi.KV_MAX_DIMS:
            raise ValueError(f"layout order {order!r}: 3 or 4 dims after the block")
        if not isinstance(heads, tuple) or len(heads) != 2:
            raise TypeError("heads must be a (first, end) tuple of global heads")
        first, end = heads
        first = _int("heads[0]", first, 0, _U32_MAX)
        end = _int("heads[1]", end, first + 1, _U32_MAX)
        self.order = dims
        self.block_size = _int("block_size", block_size, 1, _U32_MAX)
        self.head_first = first
        self.num_heads = end - first
        self.total_heads = _int("total_heads", total_heads, 1, _U32_MAX)
        self.head_bytes = _int("head_bytes", head_bytes, 1, _U32_MAX)
        self.num_parts = _int("num_parts", num_parts, 1, _U32_MAX)
        self.compat_tag = _int("compat_tag", compat_tag, 0, _U64_MAX)

    @classmethod
    def of(cls, tensor, order, heads_first=0, total_heads=None, compat_tag=0):
        """The layout of a numpy array or torch tensor shaped by `order` after
        the block dim: "NHD" is [blocks, block_size, heads, head_dim], "HND"
        [blocks, heads, block_size, head_dim]; with P, [.., parts, ..]."""
        _, names = _order(order)
        if names is None:
            raise ValueError("KvLayout.of needs a layout name such as 'NHD'")
        shape = tuple(int(d) for d in tensor.shape)
        if len(shape) != len(names) + 1:
            raise ValueError(f"a {order} cache tensor has {len(names) + 1} dims "
                             f"[blocks, {', '.join(names)}], got shape {shape}")
        ext = dict(zip(names, shape[1:]))
        item = tensor.element_size() if hasattr(tensor, "element_size") \
            else tensor.itemsize
        heads = ext["H"]
        heads_first = as_int("heads_first", heads_first)
        return cls(order, ext["N"], (heads_first, heads_first + heads),
                   total_heads if total_heads is not None else heads_first + heads,
                   ext["D"] * item, ext.get("P", 1), compat_tag)

    def _c(self):
        c = _ffi.KvLayoutC()
        c.num_dims = len(self.order)
        for i, d in enumerate(self.order):
            c.order[i] = d
        c.block_size, c.num_heads, c.head_first = (self.block_size, self.num_heads,
                                                   self.head_first)
        c.total_heads, c.head_bytes, c.num_parts = (self.total_heads, self.head_bytes,
                                                    self.num_parts)
        c.compat_tag = self.compat_tag
        return c

    @classmethod
    def _from_c(cls, c):
        k = cls.__new__(cls)
        k.order = [int(c.order[i]) for i in range(c.num_dims)]
        k.block_size, k.head_first, k.num_heads = c.block_size, c.head_first, c.num_heads
        k.total_heads, k.head_bytes = c.total_heads, c.head_bytes
        k.num_parts, k.compat_tag = c.num_parts, c.compat_tag
        return k

    @property
    def heads(self):
        return (self.head_first, self.head_first + self.num_heads)

    def __eq__(self, other):
        return isinstance(other, KvLayout) and all(
            getattr(self, a) == getattr(other, a) for a in self.__slots__)

    def __repr__(self):
        return (f"KvLayout(order={self.order}, block_size={self.block_size}, "
                f"heads={self.heads}, total_heads={self.total_heads}, "
                f"head_bytes={self.head_bytes}, num_parts={self.num_parts})")


def _table(name, blocks):
    if blocks is None:
        return None, 0
    vals = as_ints(name, blocks)
    for i, b in enumerate(vals):
        _u64(f"{name}[{i}]", b)
    arr = (ctypes.c_uint64 * max(1, len(vals)))(*vals)
    return arr, len(vals)


class Slice:
    """Token positions [tokens[0], tokens[1]) and global heads (heads=None:
    all both sides hold) from the source's block table to the
    destination's; src_first/dst_first: the position of each table's block
    0 slot 0. An empty token range moves nothing and only notifies."""

    def __init__(self, src_blocks, dst_blocks, tokens, heads=None, *, src_first=0,
                 dst_first=0, src_layers=None, dst_layers=None, tensor_num_per_layer=2):
        if not isinstance(tokens, tuple) or len(tokens) != 2:
            raise TypeError("tokens must be a (begin, end) tuple")
        if heads is not None and (not isinstance(heads, tuple) or len(heads) != 2):
            raise TypeError("heads must be a (begin, end) tuple or None")
        c = _ffi.KvSliceC()
        self._src, n = _table("src_blocks", src_blocks)
        c.src.blocks, c.src.num_blocks = self._src, n
        self._dst, m = _table("dst_blocks", dst_blocks)
        c.dst.blocks, c.dst.num_blocks = self._dst, m
        c.src.first_token = _u64("src_first", src_first)
        c.dst.first_token = _u64("dst_first", dst_first)
        c.token_begin = _u64("tokens[0]", tokens[0])
        c.token_end = _u64("tokens[1]", tokens[1])
        if heads is not None:
            c.head_begin = _u32("heads[0]", heads[0])
            c.head_end = _u32("heads[1]", heads[1])
        c.ext = _ext(src_layers, dst_layers, tensor_num_per_layer)
        self._c = c


def _slices(slices):
    items = list(slices) if not isinstance(slices, Slice) else [slices]
    if not items:
        raise ValueError("no slices")
    for i, s in enumerate(items):
        if not isinstance(s, Slice):
            raise TypeError(f"slices[{i}] must be a llmdd.Slice")
    arr = (_ffi.KvSliceC * len(items))(*[s._c for s in items])
    return items, arr


def _indexes(name, idx, n):
    # One index (a CacheIndex or a tuple of ints) or a sequence of them.
    items = [idx] if isinstance(idx, tuple) and idx and not isinstance(idx[0], tuple) \
        else list(idx)
    if len(items) == 1 and n > 1:
        items = items * n
    if len(items) != n:
        raise ValueError(f"{name}: {len(items)} indexes for {n} slices")
    return (_ffi.CacheIndexC * n)(*[_index(v, name) for v in items])


TpPiece = collections.namedtuple("TpPiece", "rank head_begin head_end")


def tp_plan(total_heads, src_tp, dst_tp, dst_rank):
    """Which source ranks hold what dst_rank needs: one TpPiece per source
    rank (an empty head range: that rank only gets the notification)."""
    args = (_u32("total_heads", total_heads), _u32("src_tp", src_tp),
            _u32("dst_tp", dst_tp), _u32("dst_rank", dst_rank))
    out = (_ffi.TpPieceC * max(1, args[1]))()
    n = ctypes.c_size_t()
    check(lib.llmdd_tp_plan(*args, out,
                            len(out), ctypes.byref(n)), "tp_plan")
    return [TpPiece(out[i].rank, out[i].head_begin, out[i].head_end)
            for i in range(n.value)]


def slice_plan_size(src_layout, dst_layout, sl):
    """(2-D runs, bytes per tensor pair) the library plans for one slice."""
    runs, nbytes = ctypes.c_uint64(), ctypes.c_uint64()
    check(lib.llmdd_kv_slice_plan_size(ctypes.byref(src_layout._c()),
                                       ctypes.byref(dst_layout._c()), ctypes.byref(sl._c),
                                       ctypes.byref(runs), ctypes.byref(nbytes)),
          "slice_plan_size")
    return runs.value, nbytes.value


# ------------------------------------------------------ Instance methods

def query_remote_layout(self, cluster_id, cache_id):
    """The KvLayout of a linked peer's cache (a check at startup)."""
    out = _ffi.KvLayoutC()
    check(self._call(lib.llmdd_query_remote_layout, _u64("cluster_id", cluster_id),
                     _int("cache_id", cache_id, -2**63, 2**63 - 1), ctypes.byref(out)),
          "query_remote_layout")
    return KvLayout._from_c(out)


def pull_slices_async(self, srcs, slices, dst, *, notify=None):
    """Posts one request pulling slice i from srcs[i] (CacheIndex, batch 0;
    one index serves every slice) into the local layout cache dst; each
    source gets `notify` after its bytes landed. Returns a Request."""
    items, arr = _slices(slices)
    idx = _indexes("srcs", srcs, len(items))
    args = (idx, arr, len(items),
            dst._ref(self) if getattr(dst, "_is_local_cache", False) else _bad_cache("dst"))
    return self._post(lib.llmdd_pull_kv_slices_async, args, (dst, items), notify)


def push_slices_async(self, src, dsts, slices, *, notify=None, layerwise=False):
    """Posts one request pushing slice i of the local layout cache src to
    dsts[i]; layerwise: layers move once layer_ready()."""
    items, arr = _slices(slices)
    idx = _indexes("dsts", dsts, len(items))
    args = (src._ref(self) if getattr(src, "_is_local_cache", False) else _bad_cache("src"),
            idx, arr, len(items))
    return self._post(lib.llmdd_push_kv_slices_async, args, (src, items), notify,
                      layerwise)


def pull_slices(self, *a, timeout_ms=None, **kw):
    """pull_slices_async(...) then wait(): raises on failure."""
    with self.pull_slices_async(*a, **kw) as r:
        r.wait(timeout_ms)


def push_slices(self, *a, timeout_ms=None, **kw):
    """push_slices_async(...) then wait(): raises on failure."""
    with self.push_slices_async(*a, **kw) as r:
        r.wait(timeout_ms)


METHODS = {f.__name__: f for f in (query_remote_layout, pull_slices_async,
                                   push_slices_async, pull_slices, push_slices)}
