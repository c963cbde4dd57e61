"""The method registry (dspark/methods.py) against the shipped checkpoints and the CLIs that read it."""

from __future__ import annotations

import pytest

from dspark.methods import METHODS, DrafterKind, checkpoint_folder, parse_methods
from dspark.models.drafter_config import Architecture, DrafterConfig, SequentialHead
from dspark.paths import CHECKPOINTS_DIR


SHIPPED = [name for name in sorted(METHODS) if checkpoint_folder(CHECKPOINTS_DIR, name).is_dir()]


def test_the_default_drafter_and_both_baselines_are_shipped():
    assert {"dspark", "dflash", "eagle", "mtp1"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_checkpoint_holds_the_kind_of_drafter_its_method_names(name):
    folder = checkpoint_folder(CHECKPOINTS_DIR, name)
    config = DrafterConfig.load(folder)
    kind = METHODS[name].kind
    if kind is DrafterKind.EAGLE:
        assert config.architecture is Architecture.EAGLE
    else:
        assert config.architecture is Architecture.DSPARK
        assert config.markov_head_type is kind.sequential_head


def test_drafter_kinds_map_onto_the_sequential_heads():
    assert DrafterKind.MARKOV.sequential_head is SequentialHead.MARKOV
    assert DrafterKind.RNN.sequential_head is SequentialHead.RNN
    assert DrafterKind.DFLASH.sequential_head is SequentialHead.NONE
    assert DrafterKind.EAGLE.sequential_head is None
    assert DrafterKind("none") is DrafterKind.DFLASH  # `dspark train --method none`


def test_parse_methods_resolves_aliases_keeps_order_and_drops_repeats():
    assert parse_methods("markov, eagle,dspark,MTP-1") == ["dspark", "eagle", "mtp1"]
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        parse_methods("dspark,medusa")
    with pytest.raises(ValueError, match="no methods"):
        parse_methods(" , ")
