"""Where host copies of KV blocks live: pinned host memory where the backend has it, so a
copy to or from the device is one transfer (the swap tier's buffers, LayerKV's host pools)."""

from __future__ import annotations

import jax


def memory_shardings(on_device: jax.sharding.Sharding | None = None
                     ) -> tuple[jax.sharding.Sharding, jax.sharding.Sharding] | tuple[None, None]:
    """(pinned host, device) placements of a buffer laid out as `on_device` (default: the
    default device; with tensor parallelism, split by KV head, so each device's shard goes
    to and from its own host memory), where the backend has pinned host memory; (None,
    None): keep host copies as numpy arrays."""
    on_device = on_device or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    kinds = {m.kind for d in on_device.device_set for m in d.addressable_memories()}
    if "pinned_host" not in kinds:
        return None, None
    return on_device.with_memory_kind("pinned_host"), on_device.with_memory_kind("device")
