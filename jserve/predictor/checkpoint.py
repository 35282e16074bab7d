"""The on-disk layout of a trained predictor directory (orbax checkpoints plus JSON).

```
DIR/
  config.json         PredictorSpec: encoder and head configuration, how it was trained
  heads/<kind>/       orbax checkpoint of one head's variables (parameters + feature norms)
  metrics.json        held-out metrics per kind (see metrics.py)
  noise.json          the simulator's noise model per kind (see noise.py)
  resume/<stage>/     orbax CheckpointManager of each training stage (params + optimizer
                      state, every epoch) for `--resume`; not needed to predict
```

Only the first four are needed at serving time; the shipped default omits `resume/`.
Heads are restored into a module built from `config.json`, so orbax checks every array's
shape against the architecture instead of trusting the files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from flax import nnx

from jserve.predictor.encoder import EncoderConfig
from jserve.predictor.heads import KINDS, Head, HeadConfig, Kind, make_head

__all__ = [
    "CONFIG_FILE", "METRICS_FILE", "NOISE_FILE", "PredictorSpec", "check_predictor_dir",
    "load_head", "resume_dir", "save_head",
]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"
NOISE_FILE = "noise.json"


@dataclass(frozen=True)
class PredictorSpec:
    """Everything needed to rebuild the heads and encode prompts as they were trained.

    `training` records how the heads were made (sizes, optimiser settings, seed); it is
    compared on `--resume` so that a resumed run continues the same training, and is
    informational otherwise.
    """

    encoder: EncoderConfig
    head: HeadConfig
    kinds: tuple[Kind, ...]
    training: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"encoder": asdict(self.encoder), "head": asdict(self.head),
                "kinds": list(self.kinds), "training": self.training}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PredictorSpec:
        kinds = tuple(data["kinds"])
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown predictor kinds {sorted(unknown)} in {CONFIG_FILE}")
        return cls(EncoderConfig(**data["encoder"]), HeadConfig(**data["head"]), kinds,
                   data.get("training", {}))

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def read(cls, directory: Path) -> PredictorSpec:
        path = directory / CONFIG_FILE
        if not path.exists():
            raise FileNotFoundError(f"{directory} is not a predictor directory (no {CONFIG_FILE})")
        return cls.from_json(json.loads(path.read_text()))


def check_predictor_dir(directory: Path, kind: Kind | None) -> PredictorSpec:
    """`directory`'s spec, or a ValueError saying what it lacks to serve `kind` (None: a
    policy that reads no predictions) both ways a predictor is used: the heads that read
    prompts and the noise model the simulator draws from."""
    if not (directory / CONFIG_FILE).is_file():
        raise ValueError(f"predictor {directory} is not a directory `jserve train-predictor` "
                         f"wrote (it has no {CONFIG_FILE})")
    try:
        spec = PredictorSpec.read(directory)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"predictor {directory}: cannot read its {CONFIG_FILE} ({e})") from None
    if kind is None:
        return spec
    if kind not in spec.kinds:
        raise ValueError(f"predictor {directory} holds no {kind!r} predictor (it has "
                         f"{', '.join(spec.kinds)}; train it with --kind {kind} or all)")
    if not (directory / "heads" / kind).is_dir():
        raise ValueError(f"predictor {directory} has no heads/{kind} checkpoint")
    try:
        noise = json.loads((directory / NOISE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"predictor {directory}: cannot read its {NOISE_FILE} ({e})") from None
    if kind not in noise:
        raise ValueError(f"predictor {directory}: {NOISE_FILE} has no {kind!r} noise model")
    return spec


def resume_dir(directory: Path, stage: str) -> Path:
    return directory.absolute() / "resume" / stage


def save_head(directory: Path, kind: Kind, head: Head) -> None:
    """Write one head's variables under `heads/<kind>`, replacing an earlier save."""
    path = directory.absolute() / "heads" / kind
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, nnx.to_pure_dict(nnx.state(head)), force=True)
    checkpointer.wait_until_finished()


def load_head(directory: Path, spec: PredictorSpec, kind: Kind) -> Head:
    """Rebuild the `kind` head from `spec` and restore its variables."""
    if kind not in spec.kinds:
        raise ValueError(f"{directory} holds no {kind!r} predictor (it has {', '.join(spec.kinds)})")
    head = make_head(kind, spec.head)
    state = nnx.state(head)
    restored = ocp.StandardCheckpointer().restore(directory.absolute() / "heads" / kind,
                                                  nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(head, state)
    return head
