"""The store benchmark's synthetic study matches the store's schema, and its fronts agree with the
O(n^2) reference (run_size asserts that itself); no timings are checked."""
from benchmarks.store_queries import run_size


def test_store_benchmark_builds_a_study_the_store_reads(tmp_path):
    result = run_size(300, repeats=1, workdir=tmp_path)
    assert result["trials"] == 300 and 0 < result["complete"] < 300
    assert 0 < result["front_size_2d"] <= result["front_size_3d"] <= result["complete"]
    assert result["dashboard_front"] == result["front_size_2d"]  # the page shows the same front
    assert 0 < result["query_rows"] <= result["complete"]  # a narrower front: not a subset of the whole one (its dominators may be filtered out)
