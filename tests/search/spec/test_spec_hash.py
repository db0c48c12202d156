"""The spec hash (``SearchSpec.spec_hash``: a study's identity in its rows, its experiment.json and
the claims) of every shipped spec as it was before the scheduler's options and default: a key added
since and left unset must not change it. And the scheduler left out: mo_asha for two objectives or
more, asha for one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from search.spec import SearchSpec, load_spec, pick_profile, to_plain
from search.spec.validation import SpecLocation, from_plain
from tests.search.spec.test_spec import GOOD

ROOT = Path(__file__).resolve().parents[3]

# (file, profile) -> spec_hash, computed at e9a9ac2 (before search.spec was split and the scheduler
# got ranking, keep_front and its default): load_spec(file, profile=profile).spec_hash
# (the claim studies in studies/: as their files were changed or added since for issue 72, matched
# arms, the split drawn per seed, the epochs scaled with the data, trained to a plateau; a changed
# file is another study)
SHIPPED = {
    ("spaces/convit_locality.yaml", "cpu"): "672c428f56eeb9e4",
    ("spaces/convit_locality.yaml", "gpu"): "43a30e5c15302628",
    ("spaces/gmm_kernels.yaml", None): "0a11a2a0db035ed0",
    ("spaces/locality_zoo.yaml", None): "57e0a7646925fed7",
    ("spaces/refiner_expansion.yaml", None): "adc7f45a5bfcfd8e",
    ("spaces/synthetic_smoke.yaml", None): "c935641ca1ccfa82",
    ("spaces/tcnn_reparam.yaml", None): "455b5db37ebef88f",
    ("studies/convit_data_10.yaml", "cpu"): "c072b3766fb68a5c",
    ("studies/convit_data_10.yaml", "gpu"): "1dcea5d2746d6a38",
    ("studies/convit_data_5.yaml", "cpu"): "71c0d5915045b731",
    ("studies/convit_data_5.yaml", "gpu"): "fbaa809d49018969",
    ("studies/convit_gpsa_ablation.yaml", "cpu"): "732c4e2bc8bcb20c",
    ("studies/convit_gpsa_ablation.yaml", "gpu"): "565f4a8f9bcc781a",
    ("studies/convit_locality_ablation.yaml", "cpu"): "f5e6d960e94f22ed",
    ("studies/convit_locality_ablation.yaml", "gpu"): "bc7621b828862574",
    ("studies/convit_more_data.yaml", "cpu"): "7ad87aaabb8a54f2",
    ("studies/convit_more_data.yaml", "gpu"): "2bd78b506013ebf8",
    ("studies/convit_small_data.yaml", "cpu"): "dea66ce099c8f5ec",
    ("studies/convit_small_data.yaml", "gpu"): "276c2ffb971a0503",
    ("studies/gmm_kernels.yaml", "cpu"): "c022b1733c646b73",
    ("studies/gmm_kernels.yaml", "gpu"): "500f53942aa169ae",
    ("studies/refiner_expansion.yaml", "cpu"): "162b8988d369ec50",
    ("studies/refiner_expansion.yaml", "gpu"): "60abdf9c3840a2df",
    ("studies/tcnn_reparam.yaml", "cpu"): "63c7f7d4a6fafada",
    ("studies/tcnn_reparam.yaml", "gpu"): "3c5a1e13f014a828",
    ("studies/vit_control.yaml", "cpu"): "484eddafc1eff06e",
    ("studies/vit_control.yaml", "gpu"): "eb197479e8c43f30",
    ("studies/gmm_mask_off.yaml", "cpu"): "8516524809775ff3",
    ("studies/gmm_mask_off.yaml", "gpu"): "3e4f584e7a01b916",
    ("studies/refiner_kernel.yaml", "cpu"): "5ec5e1c8d8a8f5e1",
    ("studies/refiner_kernel.yaml", "gpu"): "29820b201367e0fe",
}

TWO = GOOD  # two objectives, no scheduler
ONE = {**TWO, "objectives": [{"metric": "val_acc", "mode": "max"}]}
# TWO's and ONE's hashes at e9a9ac2, where a scheduler left out was asha
TWO_AS_ASHA, ONE_AS_ASHA = "21aab9fc6fb3f4db", "be72e7ab9e898eeb"


def _load(tmp_path: Path, data: dict) -> SearchSpec:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path, check_model=False)


@pytest.mark.parametrize("file,profile", sorted(SHIPPED, key=str), ids=[f"{f}:{p}" for f, p in sorted(SHIPPED, key=str)])
def test_every_shipped_spec_keeps_its_hash(file, profile):
    assert load_spec(ROOT / file, profile=profile, check_model=False).spec_hash == SHIPPED[(file, profile)]


def test_every_shipped_spec_and_profile_is_listed():
    shipped = set()
    for path in sorted((ROOT / "spaces").glob("*.yaml")) + sorted((ROOT / "studies").glob("*.yaml")):
        if path.name == "claims.yaml":  # the claims, not a study
            continue
        profiles = pick_profile(path)[2]
        shipped |= {(f"{path.parent.name}/{path.name}", p) for p in profiles or (None,)}
    assert shipped == set(SHIPPED)


def test_the_scheduler_left_out_is_mo_asha_for_several_objectives_and_asha_for_one(tmp_path):
    assert _load(tmp_path, TWO).scheduler.name == "mo_asha"
    assert _load(tmp_path, ONE).scheduler.name == "asha"
    assert _load(tmp_path, {**TWO, "scheduler": {"reduction_factor": 3}}).scheduler.name == "mo_asha"
    for name in ("asha", "mo_asha", "none"):  # given: as given
        assert _load(tmp_path, {**TWO, "scheduler": {"name": name}}).scheduler.name == name
        assert _load(tmp_path, {**ONE, "scheduler": {"name": name}}).scheduler.name == name


def test_a_default_left_unset_keeps_the_hash_it_had(tmp_path):
    # one objective: the scheduler left out is asha, as it was
    assert _load(tmp_path, ONE).spec_hash == ONE_AS_ASHA
    assert _load(tmp_path, {**TWO, "scheduler": {"name": "asha"}}).spec_hash == TWO_AS_ASHA
    # two objectives: the file now runs mo_asha, another search, so another hash ...
    two = _load(tmp_path, TWO)
    assert two.spec_hash != TWO_AS_ASHA
    # ... while a study it started before records asha (experiment.json, without the new keys): a
    # resume reads that spec back, and its rows keep the study's hash
    recorded = to_plain(two)
    recorded.update(scheduler={"name": "asha", "reduction_factor": 2.0}, source="")
    assert from_plain(SearchSpec, recorded, SpecLocation("experiment.json")).spec_hash == TWO_AS_ASHA


def test_mo_ashas_options_enter_the_hash_only_when_set(tmp_path):
    plain = _load(tmp_path, TWO)
    hashes = {plain.spec_hash}
    for options in ({"ranking": "hv_contribution"}, {"ranking": "crowding"}, {"keep_front": False},
                    {"keep_front": True}):
        spec = _load(tmp_path, {**TWO, "scheduler": options})
        assert spec.scheduler.name == "mo_asha" and all(getattr(spec.scheduler, k) == v for k, v in options.items())
        hashes.add(spec.spec_hash)
    assert len(hashes) == 5  # set, even to its default (crowding, true): the hash records what the file set


def test_the_first_rung_left_out_follows_the_epochs_by_hand():
    from search.spec.records import first_rung

    # max(1, round(epochs / 16)), Python's round: halves to even (24/16 = 1.5 -> 2, 40/16 = 2.5 -> 2)
    assert [first_rung(e) for e in (1, 8, 23, 24, 40, 52, 56, 200)] == [1, 1, 1, 2, 2, 3, 4, 12]


def test_grace_left_out_is_the_first_rung_under_a_stopping_scheduler_and_1_without(tmp_path):
    from search.study.schedulers import scheduler_for

    long = {**TWO, "budget": {"trials": 2, "max_epochs": 52}}
    assert _load(tmp_path, long).grace_epochs == 3
    assert scheduler_for(_load(tmp_path, long))._grace_period == 3  # what MO-ASHA trains to before a stop
    assert _load(tmp_path, {**long, "scheduler": {"name": "asha"}}).grace_epochs == 3
    assert _load(tmp_path, {**long, "scheduler": {"name": "none"}}).grace_epochs == 1
    assert _load(tmp_path, {**long, "budget": {"trials": 2, "max_epochs": 52, "grace_epochs": 1}}).grace_epochs == 1
    assert _load(tmp_path, TWO).grace_epochs == 1  # GOOD's 1 epoch


def test_grace_left_out_hashes_as_the_rung_it_trains(tmp_path):
    def spec(epochs: int, grace: int | None = None, scheduler: str = "mo_asha") -> SearchSpec:
        budget = {"trials": 2, "max_epochs": epochs} | ({} if grace is None else {"grace_epochs": grace})
        return _load(tmp_path, {**TWO, "budget": budget, "scheduler": {"name": scheduler}})

    # up to 23 epochs the rung left out is 1, as the default was: those studies keep their hash
    assert spec(8).spec_hash == spec(8, 1).spec_hash
    assert spec(23).spec_hash == spec(23, 1).spec_hash
    # from 24 it is another search, so another hash, the one of the rung it trains
    assert spec(52).spec_hash != spec(52, 1).spec_hash
    assert spec(52).spec_hash == spec(52, 3).spec_hash
    # without a scheduler no rung stops anything: as before
    assert spec(52, scheduler="none").spec_hash == spec(52, 1, scheduler="none").spec_hash
    # a study recorded before (experiment.json holds grace_epochs: 1) resumes as it ran
    recorded = to_plain(spec(52, 1))
    assert from_plain(SearchSpec, recorded, SpecLocation("experiment.json")).grace_epochs == 1


def test_grace_left_out_follows_a_max_epochs_override(tmp_path):
    assert _load(tmp_path, TWO).with_overrides(max_epochs=52).grace_epochs == 3
    given = {**TWO, "budget": {"trials": 2, "max_epochs": 8, "grace_epochs": 2}}
    assert _load(tmp_path, given).with_overrides(max_epochs=52).grace_epochs == 2  # given: kept
    assert _load(tmp_path, given).with_overrides(max_epochs=1).grace_epochs == 1  # cut to the epochs
