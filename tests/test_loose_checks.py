"""What the command line refuses, in one line (issue 30 item 7): a bad option value is its
`error:` line and a pointer to `--help`, not the command's whole usage text, and a
tensor-parallel size the model's heads do not split over is refused by the configuration,
for the simulator as for the real engine."""

from __future__ import annotations

import pytest

from jserve.cli import main
from jserve.config import EngineConfig
from jserve.errors import ConfigError


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--hardware", "tpu"], "jserve bench: error: argument --hardware: invalid choice: 'tpu'"),
        (["bench", "--rate", "abc"], "jserve bench: error: argument --rate: invalid float value: 'abc'"),
        (["serve", "--no-such-option"], "jserve: error: unrecognized arguments: --no-such-option"),
    ],
)
def test_a_bad_option_is_one_error_line_and_a_help_pointer(argv: list[str], message: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith(message) and err[1].endswith("--help`)"), err


def test_an_unknown_model_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`--model` takes a checkpoint directory too, so the configuration refuses a name that
    is neither, with the known names."""
    assert main(["serve", "--model", "nosuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown model 'nosuch'; known models:"), err


def test_heads_must_split_over_the_tensor_parallel_size_in_the_simulator_too(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="opt-13b: num_heads=40 does not split over tensor_parallel_size=3"):
        EngineConfig(model="opt-13b", runner="sim", tensor_parallel_size=3)
    EngineConfig(model="opt-13b", runner="sim", tensor_parallel_size=4)  # 40 heads split over 4
    assert main(["bench", "--engine", "sim", "--model", "opt-13b", "--tensor-parallel-size", "3",
                 "--workload", "fixed:8:4", "--num-requests", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: opt-13b: num_heads=40 does not split over tensor_parallel_size=3")
