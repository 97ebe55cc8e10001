"""Write a step's new K and V into the paged KV cache.

Cache layout (one layer): ``[num_blocks, num_kv_heads, block_size, head_dim]``. Token slot
``s`` is position ``s % block_size`` of block ``s // block_size``. Heads come before slots so
that one head's keys of one block are a contiguous ``[block_size, head_dim]`` tile: gathering a
sequence's blocks per head then yields ``[heads, context, head_dim]`` directly, the layout
attention reads, with no transpose copy. A negative slot marks padding and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import check_device, check_float, check_last_contiguous, tile_cap


@dataclass(frozen=True)
class CacheSlots:
    """Where the torch twin writes a step's tokens, worked out once per step for every layer:
    ``keep``, the rows of the tokens with a slot (None: all of them, the usual case), and each
    kept token's ``block`` and ``offset`` in its block."""

    keep: torch.Tensor | None
    block: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, block_size: int) -> CacheSlots:
        valid = slot_mapping >= 0
        keep = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        kept = slot_mapping if keep is None else slot_mapping[keep]
        return cls(keep, kept // block_size, kept % block_size)


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slots: CacheSlots | None = None,
) -> None:
    """Torch twin (the spec): ``cache[s // bs, :, s % bs] = new[t]`` for ``s = slot_mapping[t] >= 0``.
    ``slots``: ``CacheSlots.of(slot_mapping, bs)``, when the caller has it already."""
    if slots is None:
        slots = CacheSlots.of(slot_mapping, k_cache.shape[2])
    if slots.keep is not None:
        k, v = k[slots.keep], v[slots.keep]
    # Advanced indices around a slice: the indexed view is [T, H, D], matching k and v.
    k_cache[slots.block, :, slots.offset] = k.to(k_cache.dtype)
    v_cache[slots.block, :, slots.offset] = v.to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    H, D, BS,
    sk_t, sk_h, sv_t, sv_h,
    skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    keep = slot >= 0
    safe = tl.where(keep, slot, 0)
    block = safe // BS
    off = safe % BS
    mask = (h[:, None] < H) & (d[None, :] < D) & keep
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t64 * sk_t + h64 * sk_h + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * sv_t + h64 * sv_h + d[None, :], mask=mask)
    kdst = kc_ptr + block * skc_b + off * skc_s + h64 * skc_h + d[None, :]
    vdst = vc_ptr + block * svc_b + off * svc_s + h64 * svc_h + d[None, :]
    tl.store(kdst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vdst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton twin of :func:`store_kv_torch`: one program per (token, head tile).

    ``k``/``v`` ``[T, Hkv, D]`` may be strided views (e.g. split out of a fused QKV output) as
    long as the last dim is contiguous; so must the caches' last dim be. Slots are not bounds
    checked (that would cost a device sync on the hot path): a slot ``>= num_blocks *
    block_size`` is the caller's bug and writes out of bounds.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"store_kv: k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"store_kv: caches must both be [num_blocks, Hkv, block_size, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    t, h, d = k.shape
    if k_cache.shape[1] != h or k_cache.shape[3] != d:
        raise ValueError(f"store_kv: k {tuple(k.shape)} does not match cache {tuple(k_cache.shape)}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kv: slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"store_kv: k_cache {k_cache.dtype} vs v_cache {v_cache.dtype}")
    check_float("store_kv", k=k, v=v, k_cache=k_cache)
    check_device("store_kv", k_cache, k=k, v=v, v_cache=v_cache, slot_mapping=slot_mapping)
    check_last_contiguous("store_kv", k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(h), max(1, tile_cap() // block_d))
    grid = (t, triton.cdiv(h, block_h))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        h, d, k_cache.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=block_d,
    )
