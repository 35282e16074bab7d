"""jserve against Hugging Face transformers on tiny random checkpoints of every architecture
jserve loads (`tests/tiny_checkpoints.py`: Llama with GQA, Llama 3.1 RoPE scaling, Mistral,
Qwen2, OPT): greedy ids must be identical and logits within float32 tolerance.

    python bench/hf_reference.py            # live comparison (bench/nightly.sh); exit 1 on a mismatch
    python bench/hf_reference.py --record   # rewrite tests/data/hf_golden.npz from transformers

transformers needs torch, too heavy for CI, so CI's `tests/test_hf_checkpoint.py` compares
with the golden file recorded here instead; this script checks the file is still what
transformers computes. Needs `pip install torch transformers` (a CPU torch is enough).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from tiny_checkpoints import CONFIGS, GOLDEN, NEW_TOKENS, jserve_greedy, prompts, write_checkpoint

ATOL = 1e-4  # float32 on both sides; the logits are O(1)


def transformers_greedy(path: pathlib.Path, ps: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Greedy ids and the logits that chose them, each step a whole dense forward pass
    (no KV cache), eager attention, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids, logits = [], []
    for p in ps:
        seq, rows = list(p), []
        for _ in range(NEW_TOKENS):
            with torch.no_grad():
                row = model(torch.tensor([seq])).logits[0, -1].float().numpy()
            rows.append(row)
            seq.append(int(row.argmax()))
        ids.append(seq[len(p):])
        logits.append(np.stack(rows))
    return np.array(ids), np.stack(logits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help=f"write {GOLDEN}")
    args = parser.parse_args()
    ps = prompts()
    golden, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'architecture':<14} {'ids identical':>14} {'max |dlogit|':>13} {'min top-2 gap':>14}")
        for name in CONFIGS:
            path = write_checkpoint(name, pathlib.Path(tmp) / name, shards=2 if name == "llama-gqa" else 1)
            ref_ids, ref_logits = transformers_greedy(path, ps)
            top2 = np.sort(ref_logits, -1)[..., -2:]
            gap = float((top2[..., 1] - top2[..., 0]).min())
            golden[f"{name}/ids"], golden[f"{name}/logits"] = ref_ids, ref_logits
            ids, logits = jserve_greedy(path, ps)
            same = bool((ids == ref_ids).all())
            diff = float(np.abs(logits - ref_logits).max())
            ok &= same and diff < ATOL and gap > 10 * ATOL
            print(f"{name:<14} {str(same):>14} {diff:>13.2e} {gap:>14.2e}")
    if args.record:
        GOLDEN.parent.mkdir(exist_ok=True)
        np.savez_compressed(GOLDEN, **golden)
        print(f"wrote {GOLDEN}")
    print("OK: jserve matches transformers" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
