"""Apt-Serve's hybrid cache: a request's blocks hold every layer's attention input rows
instead of its K and V (`section.CacheType`), recomputed into K/V each step."""
