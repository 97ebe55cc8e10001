"""Packing KV-cache pages into one contiguous buffer for transfer, and unpacking them elsewhere.

Full cache layout (see :mod:`kernels.store_kv`): ``kv_cache [num_layers, 2, num_blocks, Hkv,
block_size, D]`` (``2`` = K, V). A page is one ``[Hkv, block_size, D]`` slab, contiguous in the
cache. The transfer buffer for ``block_ids`` and a layer selection is

    ``buffer [n_layers, 2, len(block_ids), Hkv, block_size, D]`` (contiguous)

with ``buffer[i, kv, j] = kv_cache[layers[i], kv, block_ids[j]]``. ``scatter_kv`` writes such
a buffer into the given blocks of another cache of the same page shape and dtype; the
destination block ids may differ from the source ones (and the cache may have a different
number of blocks). One layer: ``layers=range(l, l + 1)``.

``layers`` is ``None`` (all layers), a ``slice`` or a ``range`` with a positive step. Block ids
are a 1-D int32/int64 tensor (or a list of ints), each in ``[0, num_blocks)``; both the twins and
the Triton launchers check that on the host (a negative id would otherwise silently wrap in
torch indexing and write out of bounds in the kernel), which costs one device sync per call,
small next to moving the pages; the Triton launchers take ``check_ids=False`` to skip it. Duplicate destination ids in a scatter leave it unspecified
which page wins.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._launch import interpreting

LayerSel = slice | range | None


# --------------------------------------------------------------------------------------------
# Argument handling shared by the twins and the launchers
# --------------------------------------------------------------------------------------------


def _check_cache(op: str, kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{op}: kv_cache must be [num_layers, 2, num_blocks, Hkv, block_size, D], "
            f"got {tuple(kv_cache.shape)}"
        )


def _layer_range(op: str, layers: LayerSel, num_layers: int) -> range:
    if layers is None:
        return range(num_layers)
    if isinstance(layers, slice):
        r = range(*layers.indices(num_layers))
    elif isinstance(layers, range):
        r = layers
    else:
        raise ValueError(f"{op}: layers must be None, a slice or a range, got {type(layers).__name__}")
    if r.step <= 0:
        raise ValueError(f"{op}: layers must have a positive step, got {layers!r}")
    if len(r) and (r[0] < 0 or r[-1] >= num_layers):
        raise ValueError(f"{op}: layers {layers!r} out of range for {num_layers} layers")
    return r


def _block_ids(
    op: str, block_ids: torch.Tensor | Sequence[int], num_blocks: int, device: torch.device,
    check: bool = True,
) -> torch.Tensor:
    """``block_ids`` as a 1-D integer tensor on ``device``, checked to lie in ``[0, num_blocks)``."""
    if not isinstance(block_ids, torch.Tensor):
        block_ids = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
    if block_ids.dim() != 1:
        raise ValueError(f"{op}: block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: block_ids must be int32/int64, got {block_ids.dtype}")
    if block_ids.device != device:
        raise ValueError(f"{op}: block_ids are on {block_ids.device}, the cache on {device}")
    if check and block_ids.numel():
        lo, hi = torch.stack(torch.aminmax(block_ids)).tolist()  # one sync for both
        if lo < 0 or hi >= num_blocks:
            raise ValueError(
                f"{op}: block ids must be in [0, {num_blocks}), got min {lo}, max {hi}"
            )
    return block_ids


def _buffer_shape(kv_cache: torch.Tensor, n_layers: int, n_blocks: int) -> tuple[int, ...]:
    return (n_layers, 2, n_blocks, *kv_cache.shape[3:])


def _check_buffer(op: str, name: str, buf: torch.Tensor, kv_cache: torch.Tensor, shape: tuple) -> None:
    if tuple(buf.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}, got {tuple(buf.shape)}")
    if buf.dtype != kv_cache.dtype:
        raise ValueError(f"{op}: {name} dtype {buf.dtype} must match the cache's {kv_cache.dtype}")
    if buf.device != kv_cache.device:
        raise ValueError(f"{op}: {name} is on {buf.device}, the cache on {kv_cache.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")


def _prepare(op, kv_cache, block_ids, layers, check_ids=True):
    _check_cache(op, kv_cache)
    r = _layer_range(op, layers, kv_cache.shape[0])
    ids = _block_ids(op, block_ids, kv_cache.shape[2], kv_cache.device, check_ids)
    return r, ids, _buffer_shape(kv_cache, len(r), ids.numel())


# --------------------------------------------------------------------------------------------
# Torch twins (the spec)
# --------------------------------------------------------------------------------------------


def gather_kv_torch(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    layers: LayerSel = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``buffer[i, kv, j] = kv_cache[layers[i], kv, block_ids[j]]`` as a new contiguous tensor
    (or written into ``out``)."""
    r, ids, shape = _prepare("gather_kv", kv_cache, block_ids, layers)
    packed = kv_cache[r.start : r.stop : r.step][:, :, ids.long()]
    if out is None:
        return packed.contiguous()
    _check_buffer("gather_kv", "out", out, kv_cache, shape)
    out.copy_(packed)
    return out


def scatter_kv_torch(
    buffer: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    layers: LayerSel = None,
) -> None:
    """``kv_cache[layers[i], kv, block_ids[j]] = buffer[i, kv, j]`` (in place)."""
    r, ids, shape = _prepare("scatter_kv", kv_cache, block_ids, layers)
    _check_buffer("scatter_kv", "buffer", buffer, kv_cache, shape)
    # Indexing a basic-sliced view writes through to the cache.
    kv_cache[r.start : r.stop : r.step][:, :, ids.long()] = buffer


# --------------------------------------------------------------------------------------------
# Triton kernel: a page copy, one program per (block, layer x K/V)
# --------------------------------------------------------------------------------------------


@triton.jit
def _copy_pages_kernel(
    cache_ptr, buf_ptr, ids_ptr,
    layer0, layer_step,
    sc_l, sc_kv, sc_b,
    PAGE: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr,
):
    # Blocks on axis 0 (up to 2^31 - 1 programs), layer x K/V on axis 1 (<= 65535 on CUDA).
    j = tl.program_id(0)
    lk = tl.program_id(1)
    n_blocks = tl.num_programs(0)
    layer = (layer0 + (lk // 2) * layer_step).to(tl.int64)
    kv = (lk % 2).to(tl.int64)
    blk = tl.load(ids_ptr + j).to(tl.int64)
    page = cache_ptr + layer * sc_l + kv * sc_kv + blk * sc_b
    packed = buf_ptr + (lk.to(tl.int64) * n_blocks + j) * PAGE
    for start in range(0, PAGE, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < PAGE
        if GATHER:
            tl.store(packed + offs, tl.load(page + offs, mask=mask), mask=mask)
        else:
            tl.store(page + offs, tl.load(packed + offs, mask=mask), mask=mask)


def _launch(kv_cache, buf, ids, r, gather: bool) -> None:
    n_layers, n_blocks = len(r), ids.numel()
    if n_layers == 0 or n_blocks == 0:
        return
    _, _, _, h, bs, d = kv_cache.shape
    page = h * bs * d
    if page == 0:
        return
    if not kv_cache[0, 0, 0].is_contiguous():
        raise ValueError(
            f"kv_cache pages [Hkv, block_size, D] must be contiguous (strides {kv_cache.stride()})"
        )
    block = min(triton.next_power_of_2(page), (1 << 16) if interpreting() else 4096)
    _copy_pages_kernel[(n_blocks, 2 * n_layers)](
        kv_cache, buf, ids.contiguous(),
        r.start, r.step,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        PAGE=page, BLOCK=block, GATHER=gather,
    )


def gather_kv_triton(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    layers: LayerSel = None,
    out: torch.Tensor | None = None,
    *,
    check_ids: bool = True,
) -> torch.Tensor:
    """Triton twin of :func:`gather_kv_torch`; ``out`` (contiguous, buffer shape, cache dtype
    and device) is written and returned if given. ``check_ids=False`` skips the host-side
    range check of the ids and its device sync (for callers whose ids come from the block
    allocator, or under CUDA-graph capture); out-of-range ids then read out of bounds."""
    r, ids, shape = _prepare("gather_kv", kv_cache, block_ids, layers, check_ids)
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    else:
        _check_buffer("gather_kv", "out", out, kv_cache, shape)
    _launch(kv_cache, out, ids, r, gather=True)
    return out


def scatter_kv_triton(
    buffer: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    layers: LayerSel = None,
    *,
    check_ids: bool = True,
) -> None:
    """Triton twin of :func:`scatter_kv_torch`; ``check_ids`` as in :func:`gather_kv_triton`
    (unchecked out-of-range ids write out of bounds)."""
    r, ids, shape = _prepare("scatter_kv", kv_cache, block_ids, layers, check_ids)
    _check_buffer("scatter_kv", "buffer", buffer, kv_cache, shape)
    _launch(kv_cache, buffer, ids, r, gather=False)
