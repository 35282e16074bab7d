"""An engine whose requests have their prompts done and decode on, for the benches that time
its decode steps (`engine_vs_jit.py`, `host_step.py`). Only the public engine is used, so a
child process can build it on an older checkout too."""

from __future__ import annotations

import numpy as np

from jserve import SamplingParams
from jserve.builder import BuiltEngine, build_engine
from jserve.config import EngineConfig

PROMPT = 32  # tokens of each prompt: the context the first decode starts from
BLOCK = 16


def decoding_engine(model: str, batch: int, max_len: int) -> BuiltEngine:
    """`batch` greedy requests of random `PROMPT`-token prompts that decode to `max_len`
    (EOS ignored), stepped until every one has its first token."""
    built = build_engine(EngineConfig(model=model, max_num_seqs=batch, max_model_len=max_len,
                                      num_blocks=batch * -(-max_len // BLOCK) + 8, block_size=BLOCK))
    engine = built.engine
    rng = np.random.default_rng(0)
    vocab = built.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_len - PROMPT, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(1, vocab, PROMPT).tolist(), params)
    while any(not r.output_token_ids for r in engine.state.live.requests.values()):
        engine.step()
    return built
