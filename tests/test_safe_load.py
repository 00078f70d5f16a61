"""Safe shard loading accepts every way a supported Python pickles DeepSpeed's records, and nothing more.

Python pickles an enum member by value (`ZeroStageEnum(2)`: 3.10, 3.11.5+, 3.12, 3.13) or by name
(`getattr(ZeroStageEnum, 'gradients')`: 3.11.0-3.11.4, Debian 12's 3.11.2). Both forms are built
here explicitly, so these tests fail on any interpreter if either form is refused.
"""

from __future__ import annotations

import collections

import pytest
import torch

from llmft.checkpoint.zero import CheckpointError, load_shard


class Reduce:
    """Pickles as `fn(*args)`: lets a test write exactly the opcodes a given Python would write."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def zero_stage_enum():
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum


def save(tmp_path, payload, name="shard.pt"):
    path = tmp_path / name
    torch.save(payload, path)
    return path


def test_enum_pickled_by_value_and_by_name_both_load_as_the_stage(tmp_path):
    enum_cls = zero_stage_enum()
    by_value = save(tmp_path, {"zero_stage": Reduce(enum_cls, 2), "w": torch.ones(3)}, "by_value.pt")
    by_name = save(tmp_path, {"zero_stage": Reduce(getattr, enum_cls, "gradients"), "w": torch.ones(3)}, "by_name.pt")
    assert _pickle_mentions(by_name, "getattr") and not _pickle_mentions(by_value, "getattr")
    for path in (by_value, by_name):
        loaded = load_shard(path)
        assert loaded["zero_stage"] == 2 and int(loaded["zero_stage"]) == 2
        assert torch.equal(loaded["w"], torch.ones(3))


@pytest.mark.parametrize("member, value", [("disabled", 0), ("optimizer_states", 1), ("gradients", 2), ("weights", 3)])
def test_every_zero_stage_member_loads_by_name(tmp_path, member, value):
    path = save(tmp_path, {"zero_stage": Reduce(getattr, zero_stage_enum(), member)})
    assert int(load_shard(path)["zero_stage"]) == value


def test_the_current_interpreter_pickles_the_real_enum_in_a_loadable_form(tmp_path):
    """Whatever this Python does natively (by value or by name), the loader accepts it."""
    path = save(tmp_path, {"zero_stage": zero_stage_enum().optimizer_states})
    assert int(load_shard(path)["zero_stage"]) == 1


@pytest.mark.parametrize(
    "payload, refused",
    [
        (Reduce(getattr, collections.OrderedDict, "fromkeys"), "builtins.getattr on OrderedDict.fromkeys"),
        (Reduce(getattr, "zero_stage_enum", "__class__"), "builtins.getattr on ZeroStageEnum.__class__"),
        (Reduce(getattr, "zero_stage_enum", "_missing_"), "builtins.getattr on ZeroStageEnum._missing_"),
        (Reduce(getattr, "zero_stage_enum", "__reduce_ex__"), "builtins.getattr on ZeroStageEnum.__reduce_ex__"),
        (Reduce(getattr, torch.Tensor, "__setstate__"), "builtins.getattr on Tensor.__setstate__"),
        (Reduce(eval, "1+1"), "eval"),
    ],
)
def test_any_other_getattr_or_callable_is_refused_and_named(tmp_path, payload, refused):
    if payload.args and payload.args[0] == "zero_stage_enum":
        payload.args = (zero_stage_enum(), *payload.args[1:])
    path = save(tmp_path, {"x": payload})
    with pytest.raises(CheckpointError) as err:
        load_shard(path)
    message = str(err.value)
    assert f"contains the Python object {refused}" in message
    assert "--trust_checkpoint" in message and "\n" not in message


def _pickle_mentions(path, word: str) -> bool:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return any(word.encode() in z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
