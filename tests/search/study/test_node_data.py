"""A trial prepares the dataset on its own node (search.study.trainable.on_this_node): in the node's
cache, once per process, and only when it holds the driver's content."""

from __future__ import annotations

import dataclasses

import pytest

from search.study.trainable import TrialTemplate, _prepared_here, on_this_node
from trainers.config import ThroughputSettings, TrainSettings
from trainers.data import DatasetRequest, prepare_dataset
from trainers.errors import ConfigError

REQUEST = DatasetRequest(name="synthetic", val_fraction=0.2)


def _template(data, **kw) -> TrialTemplate:
    return TrialTemplate(models={"ls_convit_nano": {}}, data=data, epochs=1, train=TrainSettings(),
                         throughput=ThroughputSettings(), patience=None, seed=0, dataset=REQUEST, **kw)


def test_each_node_prepares_into_its_own_cache(tmp_path, monkeypatch):
    driver = prepare_dataset(REQUEST, cache_dir=tmp_path / "driver")
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "node"))  # the node's environment
    _prepared_here.clear()
    here = on_this_node(_template(driver))
    assert here.data.content_hash == driver.content_hash
    assert here.data.train_path.startswith(str(tmp_path / "node")) and here.throughput_cache_dir == str(tmp_path / "node" / "throughput")
    assert on_this_node(_template(driver)).data == here.data and len(_prepared_here) == 1  # a reused actor: no second look
    shared = on_this_node(_template(driver, cache_dir=str(tmp_path / "shared")))  # --cache-dir: the same on every node
    assert shared.data.train_path.startswith(str(tmp_path / "shared"))
    assert on_this_node(dataclasses.replace(_template(driver), dataset=None)).data == driver  # nothing to prepare


def test_a_node_with_other_data_fails_with_the_fix(tmp_path, monkeypatch):
    driver = prepare_dataset(REQUEST, cache_dir=tmp_path / "driver")
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "node"))
    other = dataclasses.replace(driver, content_hash="0" * 64)  # the driver saw different files
    with pytest.raises(ConfigError, match="differs from the driver's .* same files at the same path on every node"):
        on_this_node(_template(other))
