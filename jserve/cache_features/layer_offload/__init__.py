"""LayerKV's layer-wise residency: a request may keep only some of its layers' KV on the
device and the others in the host tier (`section.KeptLayers`), in per-layer slots."""
