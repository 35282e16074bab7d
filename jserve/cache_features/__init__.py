"""Cache features: what a request's cache may be besides whole-block paged KV on the device.

The engine's core (plan, view, plan check, plan apply, state) knows only whole blocks; each
feature plugs in through `protocol.CacheFeature` and is listed once in `registry.FEATURES`.
A policy builds a feature's part of a plan through that feature's `section` module.
"""
