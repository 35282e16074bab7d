"""Checkpoints read straight onto a mesh, in a process of its own with forced CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/checkpoint_sharding_checks.py DIR...

For each tiny checkpoint directory: greedy ids over 4 devices (`tensor_parallel_size=4`,
KV heads repeated where there are 2), each split parameter's shards as the Megatron specs
say, and how many of the loader's reads (its callback's, recorded) took a whole tensor: one
per replicated tensor (a block parameter holds one a layer), and none of a split one. Prints one JSON object; `tests/test_hf_checkpoint.py` asserts on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
from flax import nnx
from tiny_checkpoints import NEW_TOKENS, prompts

from jserve import LLM, SamplingParams
from jserve.models import hf_checkpoint
from jserve.models.paged import is_stacked
from jserve.runners.sharding import REPLICATED, param_spec

READS: list[bool] = []  # per read the loader made: whether it read the whole stored tensor
_read = hf_checkpoint._Source.read


def _recorded(self: hf_checkpoint._Source, index: tuple[slice, ...]) -> np.ndarray:
    out = _read(self, index)
    READS.append(bool(out.size == np.prod(self.tensor.get_shape())))
    return out


def check(path: str) -> dict:
    READS.clear()
    hf_checkpoint._Source.read = _recorded
    llm = LLM(path, tensor_parallel_size=4, num_blocks=64, warmup=False)
    hf_checkpoint._Source.read = _read
    outs = llm.generate(prompt_token_ids=prompts(), use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    split, replicated, whole = 0, 0, []
    for param, x in jax.tree_util.tree_flatten_with_path(nnx.state(llm.model.model))[0]:
        if param_spec(param) == REPLICATED:  # a block parameter: one stored tensor per layer
            replicated += x.shape[0] if is_stacked(param) else 1
            continue
        split += 1
        shards = {s.data.shape for s in x.addressable_shards}
        if len(shards) != 1 or np.prod(next(iter(shards))) * 4 != x.size:
            whole.append(jax.tree_util.keystr(param))
    return dict(ids=[o.token_ids for o in outs], kv_heads=llm.model.model.cfg.num_kv_heads,
                split_params=split, replicated_params=replicated, not_split=whole,
                devices=len(jax.devices()), whole_reads=sum(READS), reads=len(READS))


if __name__ == "__main__":
    print(json.dumps({Path(p).name: check(p) for p in sys.argv[1:]}))
