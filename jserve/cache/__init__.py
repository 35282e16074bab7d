"""KV-cache bookkeeping: block allocation, the prefix index, and cache sizing."""
