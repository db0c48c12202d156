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


def test_with_a_split_per_trial_each_trial_trains_on_the_data_its_own_seed_draws(tmp_path, monkeypatch):
    driver = {seed: prepare_dataset(dataclasses.replace(REQUEST, seed=seed), cache_dir=tmp_path / "driver")
              for seed in (0, 1)}
    assert driver[0].content_hash != driver[1].content_hash  # another seed, another split
    monkeypatch.setenv("LOCALITY_SEARCH_CACHE", str(tmp_path / "node"))
    _prepared_here.clear()
    per_trial = _template(driver[0], seed_data=driver)
    for seed in (0, 1):
        here = on_this_node(per_trial, seed)
        assert here.data.content_hash == driver[seed].content_hash and here.data.train_path.startswith(str(tmp_path / "node"))
    assert on_this_node(per_trial).data.content_hash == driver[0].content_hash  # no seed given: the study's
    # a seed the driver did not plan is prepared all the same, as that seed draws it
    assert on_this_node(per_trial, 5).data.content_hash not in {d.content_hash for d in driver.values()}
    # the default (the study's seed draws one split): every trial on the study's data, whatever its seed
    assert on_this_node(_template(driver[0]), 1).data.content_hash == driver[0].content_hash
    # and a node whose files differ from the driver's for that seed fails as before
    wrong = {0: driver[0], 1: dataclasses.replace(driver[1], content_hash="0" * 64)}
    with pytest.raises(ConfigError, match="differs from the driver's"):
        on_this_node(_template(driver[0], seed_data=wrong), 1)


def test_the_run_prepares_each_trial_seeds_split_before_the_first_trial(tmp_path):
    import yaml

    from search.spec import load_spec
    from search.study.prepare import seed_datasets

    raw = {"name": "t", "dataset": {"name": "synthetic", "val_fraction": 0.2, "split_seed": "trial"},
           "model": {"name": "ls_convit_nano"}, "space": {"locality_strength": {"type": "choice", "values": [1.0]}},
           "objectives": [{"metric": "val_acc", "mode": "max"}], "budget": {"max_epochs": 1},
           "algorithm": {"name": "grid", "seed": 3, "seeds": 2}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    per_seed = seed_datasets(load_spec(path, check_model=False), tmp_path / "cache")
    assert sorted(per_seed) == [3, 4]
    assert per_seed[3].content_hash == prepare_dataset(dataclasses.replace(REQUEST, seed=3),
                                                       cache_dir=tmp_path / "cache").content_hash
    raw["dataset"].pop("split_seed")
    path.write_text(yaml.safe_dump(raw))
    assert seed_datasets(load_spec(path, check_model=False), tmp_path / "cache") is None


def test_an_exported_trial_names_the_seed_that_drew_its_data(tmp_path):
    import yaml

    from search.spec import load_spec
    from search.study.export import ExportedDataset, _dataset

    raw = {"name": "t", "dataset": {"name": "synthetic", "split_seed": "trial"}, "model": {"name": "ls_convit_nano"},
           "space": {"locality_strength": {"type": "choice", "values": [1.0]}},
           "objectives": [{"metric": "val_acc", "mode": "max"}], "budget": {"max_epochs": 1},
           "algorithm": {"name": "grid", "seed": 3, "seeds": 2}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    per_trial = _dataset(load_spec(path, check_model=False), 4)
    assert per_trial["seed"] == 4 and ExportedDataset.model_validate(per_trial).request().seed == 4
    raw["dataset"].pop("split_seed")
    path.write_text(yaml.safe_dump(raw))
    shared = _dataset(load_spec(path, check_model=False), 4)
    assert shared["seed"] == 3 and "split_seed" not in shared  # as exported before the key existed
