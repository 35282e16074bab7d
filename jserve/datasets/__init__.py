"""Public datasets jserve reads: ShareGPT conversations for benchmarks and predictor training."""
